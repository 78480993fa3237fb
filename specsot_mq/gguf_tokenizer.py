"""A GGUF's byte-level BPE vocabulary (`tokenizer.ggml.model` "gpt2": Llama 3's, Qwen's, SmolLM's)
as a `tokenizers` Tokenizer, built straight from the header's fields.

It is the tokenizer transformers builds from the same file (its GPT2Tokenizer over the vocabulary
and merges, the file's control and user-defined tokens added, the text split by the regex of the
file's pre-tokenizer), without importing transformers or reading the file a second time with
gguf's GGUFReader (the default model's whole conversion: 20.0 s -> 2.2 s on 2 cores,
`python benchmarks/convert.py --against 8ce46f8`). Other vocabularies (sentencepiece's "llama")
still go through transformers (gguf_convert)."""

from __future__ import annotations

import sys
from functools import cache

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

from .errors import SpecSotError

# How a vocabulary's text is split before its merges apply, by `tokenizer.ggml.pre` (the regex of
# the model's own tokenizer.json, as llama.cpp splits by it too). Every other known name splits
# as GPT-2 does (the ByteLevel pre-tokenizer's own regex).
_LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
           r"|\s*[\r\n]+|\s+(?!\S)|\s+")  # fmt: skip
_QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
          r"|\s*[\r\n]+|\s+(?!\S)|\s+")  # fmt: skip
SPLITS = {
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "smaug-bpe", "dbrx", "falcon3", "pixtral"), _LLAMA3),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "megrez"), _QWEN2),
}
# Names whose split GPT-2's regex gives: the same regex, or (smollm, starcoder, refact) each digit
# on its own first, which changes no tokens where, as there, no merge joins a digit to anything.
GPT2_SPLIT = ("gpt-2", "default", "smollm", "starcoder", "refact", "mpt", "olmo", "jais")
CONTROL, USER_DEFINED = 3, 4  # llama.cpp's token types


@cache
def byte_spelling() -> dict[int, str]:
    """GPT-2's byte-level alphabet: each byte's character (printable Latin-1 ones as themselves,
    the others moved past 255 in order)."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    moved = [b for b in range(256) if b not in kept]
    return {**{b: chr(b) for b in kept}, **{b: chr(256 + i) for i, b in enumerate(moved)}}


def byte_level_tokenizer(fields: dict, name: str) -> tuple[Tokenizer, dict]:
    """(the Tokenizer, its tokenizer_config.json entries) for a "gpt2" vocabulary's fields; `name`
    (the file's) names it in the one line said when its pre-tokenizer is one this does not know."""
    spelling = byte_spelling()
    alphabet = set(spelling.values())
    tokens = list(fields["tokenizer.ggml.tokens"])
    # A token outside the alphabet (a file that spelt one in plain UTF-8) is spelt in it, as
    # transformers does; where two tokens share a spelling, the later id keeps it.
    vocab = {t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode()): i for i, t in enumerate(tokens)}
    if "tokenizer.ggml.merges" not in fields:
        raise SpecSotError(f"{name} has a byte-level vocabulary without its merges (tokenizer.ggml.merges): "
                           "use a GGUF written by llama.cpp's converter, or the model's Hugging Face folder")  # fmt: skip
    merges = [tuple(m.split(" ", 1)) for m in fields["tokenizer.ggml.merges"]]
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, continuing_subword_prefix="", end_of_word_suffix="",
                                     fuse_unk=False))  # fmt: skip
    pre = fields.get("tokenizer.ggml.pre", "default")
    if pre in SPLITS:
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(SPLITS[pre]), behavior="isolated"),
                                                           pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])  # fmt: skip
    else:
        if pre not in GPT2_SPLIT:
            print(f"{name}: its pre-tokenizer '{pre}' is not one this converter knows; its text is split as GPT-2's is, "
                  "so a few tokens may differ from the model's own tokenizer's", file=sys.stderr)  # fmt: skip
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()

    # A control token spelt outside the alphabet is a mislabel of llama.cpp's (adding it would grow
    # the vocabulary past the model's rows): left as it is, as transformers leaves it.
    types = list(fields.get("tokenizer.ggml.token_type", ()))
    ids = {key: i for key, field in (("bos_token", "bos"), ("eos_token", "eos"), ("unk_token", "unknown"),
                                     ("pad_token", "padding")) if (i := fields.get(f"tokenizer.ggml.{field}_token_id")) is not None}  # fmt: skip
    named = {key: tokens[i] for key, i in ids.items()}
    control = [t for t, kind in zip(tokens, types) if kind == CONTROL and set(t) <= alphabet]
    special = list(dict.fromkeys([*control, *(t for t in named.values() if t in vocab)]))
    tokenizer.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in special])
    user = [t for t, kind in zip(tokens, types) if kind == USER_DEFINED and t in vocab]
    tokenizer.add_tokens([AddedToken(t, normalized=False, special=False) for t in user])

    # What encode(..., add_special_tokens=True) adds: the file's bos and eos where it says to.
    add = {end: bool(fields.get(f"tokenizer.ggml.add_{end}_token", False)) and f"{end}_token" in named for end in ("bos", "eos")}
    ends = [(named[f"{end}_token"], ids[f"{end}_token"]) for end in ("bos", "eos") if add[end]]

    def around(sequence: str, type_id: int) -> str:
        return " ".join([*([f"{named['bos_token']}:{type_id}"] if add["bos"] else []), f"${sequence}:{type_id}",
                         *([f"{named['eos_token']}:{type_id}"] if add["eos"] else [])])  # fmt: skip

    tokenizer.post_processor = processors.TemplateProcessing(
        single=around("A", 0), pair=f"{around('A', 0)} {around('B', 1)}", special_tokens=ends
    )
    config = {**named, "add_bos_token": add["bos"], "add_eos_token": add["eos"], "tokenizer_class": "PreTrainedTokenizerFast"}
    if "tokenizer.chat_template" in fields:
        config["chat_template"] = fields["tokenizer.chat_template"]
    return tokenizer, config
