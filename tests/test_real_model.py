"""The real default model (SmolLM2-135M-Instruct, its weights dequantized to fp32): our greedy
decoding equals transformers' `generate` token for token, and streamed text is UTF-8 safe."""

import json
from pathlib import Path

import pytest
import torch

from specsot_mq.generate import Generator
from specsot_mq.loader import load_model, transformers_model
from specsot_mq.sampling import SamplingParams
from specsot_mq.tokenizer import Detokenizer, chat_prompt_ids, load_tokenizer

pytestmark = pytest.mark.slow
MT_BENCH = Path(__file__).resolve().parents[2] / "shared" / "data" / "mt_bench_questions.jsonl"


def mt_bench_first_turns(n: int) -> list[str]:
    if not MT_BENCH.exists():
        pytest.skip(f"{MT_BENCH} not found (the benchmark questions live in ../shared/data)")
    rows = [json.loads(line) for line in MT_BENCH.read_text().splitlines() if line.strip()]
    return [r["turns"][0] for r in rows[:n]]


@pytest.fixture(scope="module")
def tokenizer(default_model_dir):
    return load_tokenizer(default_model_dir)


def test_greedy_64_tokens_equal_transformers_generate(default_model_dir, tokenizer):
    hf = transformers_model(default_model_dir, torch.float32)
    gen = Generator(load_model(default_model_dir, dtype=torch.float32, quantize="none"), tokenizer, max_len=1024)
    for question in mt_bench_first_turns(5):
        ids = chat_prompt_ids(tokenizer, question)
        with torch.no_grad():
            ref = hf.generate(
                torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                max_new_tokens=64, do_sample=False, pad_token_id=tokenizer.eos_token_id,
            )[0, len(ids) :].tolist()  # fmt: skip
        ours = gen.generate(ids, SamplingParams(max_tokens=64)).token_ids
        assert ours == ref, question[:60]


@pytest.mark.parametrize("text", ["Ünïcödé façade — naïve café", "日本語のテキスト、絵文字 🚀🔥 too", "€ ∑ 𝔘 👩‍💻 ok"])
def test_streamed_text_never_splits_a_character(tokenizer, text):
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert len(ids) > len(text.split())  # some characters span several tokens
    detok = Detokenizer(tokenizer)
    pieces = [detok.add([i]) for i in ids] + [detok.flush()]
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == tokenizer.decode(ids)
