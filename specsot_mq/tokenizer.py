"""Tokenizer loading, chat prompts, and UTF-8-safe incremental detokenisation."""

from __future__ import annotations

from pathlib import Path

from specsot_mq.errors import SpecSotError


def load_tokenizer(folder: str | Path):
    """The model folder's fast tokenizer (transformers), with its chat template."""
    from transformers import AutoTokenizer  # heavy import, paid only when a model is loaded

    try:
        return AutoTokenizer.from_pretrained(str(folder))
    except (OSError, ValueError) as e:
        raise SpecSotError(f"{folder} has no usable tokenizer ({e}): re-pull the model") from None


def chat_prompt_ids(tokenizer, messages: list[dict] | str, system: str | None = None) -> list[int]:
    """Token ids of a chat prompt ending where the assistant's answer begins."""
    if isinstance(messages, str):
        messages = [{"role": "user", "content": messages}]
    if system is not None:
        messages = [{"role": "system", "content": system}, *messages]
    if tokenizer.chat_template:
        out = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        # transformers 5 returns a BatchEncoding here; older versions a plain list.
        return list(out["input_ids"] if hasattr(out, "keys") else out)
    text = "\n".join(m["content"] for m in messages)
    return tokenizer.encode(text)


class Detokenizer:
    """Turns a growing list of token ids into text deltas without ever emitting half a character.

    Byte-level BPE splits one character over several tokens; decoding a token alone then yields
    U+FFFD. We decode a short window that starts a few tokens back (so leading-space and merge
    effects are right) and only release text once it no longer ends in an incomplete character.
    """

    def __init__(self, tokenizer, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special = skip_special_tokens
        self.ids: list[int] = []
        self.prefix_offset = 0  # window start
        self.read_offset = 0  # tokens before this are already released as text

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special)

    def add(self, new_ids: list[int]) -> str:
        """Append tokens; return the text they complete (possibly empty)."""
        self.ids.extend(new_ids)
        prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
        full = self._decode(self.ids[self.prefix_offset :])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            return full[len(prefix) :]
        return ""

    def flush(self) -> str:
        """Whatever is held back at the end of generation (an incomplete character stays U+FFFD)."""
        prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
        full = self._decode(self.ids[self.prefix_offset :])
        self.prefix_offset = self.read_offset = len(self.ids)
        return full[len(prefix) :]
