"""Tokenizer loading, chat prompts, and UTF-8-safe incremental detokenisation.

A model folder's tokenizer is its tokenizer.json, run by the `tokenizers` library, with its chat
template rendered by jinja2 as transformers renders it: the same ids as transformers' tokenizer,
without importing transformers (whose tokenizer classes alone take about 140 MB of memory in
every process, more than a stage without a model needs in all)."""

from __future__ import annotations

import json
from functools import cached_property, lru_cache
from pathlib import Path

from specsot_mq.errors import SpecSotError
from specsot_mq.openmp import release_freed_memory

SPECIAL = ("bos_token", "eos_token", "unk_token", "pad_token")  # what a chat template may name
# Special tokens that end a turn in common chat formats (Llama 3's; ChatML's, as Qwen and SmolLM
# use it; Phi-3's <|end|>, Gemma's <end_of_turn>), where a file's eos may name another: llama.cpp
# ends generation at these too, found by their text.
END_OF_TURN = ("<|eot_id|>", "<|eom_id|>", "<|im_end|>", "<|endoftext|>", "<|end_of_text|>", "<|end|>", "<end_of_turn>")
# A reasoning model's think block opens with this; where its template forces it open, it is closed.
THINK = "<think>"


def load_tokenizer(folder: str | Path) -> ChatTokenizer:
    """The model folder's tokenizer, with its chat template."""
    return ChatTokenizer(Path(folder))


class ChatTokenizer:
    """A fast tokenizer and its chat template: the calls the project makes of a tokenizer
    (encode, decode, apply_chat_template, eos_token_id, len), answered as transformers'
    PreTrainedTokenizerFast answers them; and end_ids, the tokens that end an answer."""

    def __init__(self, folder: Path):
        from tokenizers import Tokenizer

        try:
            self.backend = Tokenizer.from_file(str(folder / "tokenizer.json"))
            config_path = folder / "tokenizer_config.json"
            config = json.loads(config_path.read_text()) if config_path.is_file() else {}
        except Exception as e:  # the tokenizers library raises plain Exceptions
            raise SpecSotError(f"{folder} has no usable tokenizer ({e}): re-pull the model") from None
        release_freed_memory()  # the parsed JSON of a large vocabulary, freed into the heap
        template = folder / "chat_template.jinja"
        self.chat_template = template.read_text() if template.is_file() else config.get("chat_template")
        # A special token is written as a string or as an added token's record ({"content": ...}).
        self.special = {name: t.get("content") if isinstance(t, dict) else t
                        for name in SPECIAL if (t := config.get(name)) is not None}  # fmt: skip
        self.eos_token = self.special.get("eos_token")
        self.eos_token_id = self._id(self.eos_token)
        self.pad_token_id = self._id(self.special.get("pad_token"))

    @cached_property
    def end_ids(self) -> frozenset[int]:
        """The tokens that end an answer: the eos token, and the special tokens of END_OF_TURN the
        vocabulary holds (a Llama 3 file whose eos is <|end_of_text|> ends its chat turns with
        <|eot_id|>; Qwen2.5's model may end with <|endoftext|> where its eos is <|im_end|>)."""
        special = {t.content for t in self.backend.get_added_tokens_decoder().values() if t.special}
        ids = {self.eos_token_id, *(self._id(t) for t in END_OF_TURN if t in special)}
        return frozenset(ids - {None})

    def _id(self, token: str | None) -> int | None:
        return None if token is None else self.backend.token_to_id(token)

    def __len__(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = False, tokenize: bool = True):
        """The chat rendered by its template (the ids of the text, no special tokens added). A
        template that lets the model think first (Qwen3's, SmolLM3's: `enable_thinking`) is
        rendered with thinking off, as transformers renders it given enable_thinking=False: a
        skeleton, a point and a direct answer are each the answer itself, where a think block
        before each would spend the phase's tokens before a word of it. A template that opens the
        think block itself, whatever it is given (DeepSeek-R1's distills, QwQ: the prompt ends
        "<think>\n"), gets it closed at once, empty, as Qwen3's template writes it."""
        text = self._template.render(messages=messages, tools=None, documents=None, enable_thinking=False,
                                     add_generation_prompt=add_generation_prompt, **self.special)  # fmt: skip
        if add_generation_prompt and (end := text.rstrip()).endswith(THINK):
            text = end + "\n\n</think>\n\n"
        return list(self._chat_ids(text)) if tokenize else text

    @cached_property
    def _chat_ids(self):
        """A rendered chat's ids, the last few remembered: a request's phases render the same
        direct prompt more than once (the router, the prompt's size, the answer)."""
        return lru_cache(maxsize=64)(lambda text: tuple(self.encode(text, add_special_tokens=False)))

    @cached_property
    def _template(self):
        """The chat template compiled in the sandbox, with the settings and helpers transformers gives it."""
        from datetime import datetime

        import jinja2.ext
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message):
            raise jinja2.exceptions.TemplateError(message)

        class Generation(jinja2.ext.Extension):
            """`{% generation %}...{% endgeneration %}`, which templates written for training put
            around the assistant's words (transformers' assistant mask): its body as it is."""

            tags = {"generation"}

            def parse(self, parser):
                next(parser.stream)
                return parser.parse_statements(("name:endgeneration",), drop_needle=True)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=[jinja2.ext.loopcontrols, Generation])  # fmt: skip
        env.filters["tojson"] = lambda x, ensure_ascii=False, indent=None, separators=None, sort_keys=False: json.dumps(
            x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)  # fmt: skip
        env.globals.update(raise_exception=raise_exception, strftime_now=lambda f: datetime.now().strftime(f))
        try:
            return env.from_string(self.chat_template)
        except jinja2.exceptions.TemplateSyntaxError as e:
            raise SpecSotError(f"the model's chat template cannot be read ({e.message}, its line {e.lineno}): "
                               "use a model folder or GGUF file whose template transformers renders") from None  # fmt: skip


def chat_prompt_ids(tokenizer, messages: list[dict] | str) -> list[int]:
    """Token ids of a chat prompt ending where the assistant's answer begins. A template that
    refuses the conversation as it is (Mistral's and Llama 2's: roles must alternate, and some
    take no system message; a point's prompt has the conversation's earlier questions without
    their answers) gets it again with the system message at the head of the first question and
    each run of one role's messages joined; one it still refuses is a SpecSotError with its reason."""
    if isinstance(messages, str):
        messages = [{"role": "user", "content": messages}]
    if not tokenizer.chat_template:
        return tokenizer.encode("\n".join(m["content"] for m in messages))
    from jinja2.exceptions import TemplateError

    try:
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    except TemplateError as refused:
        joined = alternating(messages)
        try:
            if joined != messages:
                return tokenizer.apply_chat_template(joined, add_generation_prompt=True)
        except TemplateError as again:
            refused = again
        raise SpecSotError(f"the model's chat template refuses this conversation ({refused}): "
                           "send turns that alternate user and assistant, ending with the user's") from None  # fmt: skip


def alternating(messages: list[dict]) -> list[dict]:
    """The conversation as strict templates take it: a system message joined to the head of the
    first user message, then each run of messages of one role joined into one, by blank lines."""
    system = [m["content"] for m in messages if m["role"] == "system"]
    out: list[dict] = []
    for m in messages:
        if m["role"] == "system":
            continue
        if out and out[-1]["role"] == m["role"]:
            out[-1] = {"role": m["role"], "content": out[-1]["content"] + "\n\n" + m["content"]}
        else:
            out.append({"role": m["role"], "content": m["content"]})
    if system and out and out[0]["role"] == "user":
        out[0] = {"role": "user", "content": "\n\n".join([*system, out[0]["content"]])}
    elif system:
        out.insert(0, {"role": "user", "content": "\n\n".join(system)})
    return out


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
