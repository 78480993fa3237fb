"""The same promises on a CUDA GPU, where there is one (skipped elsewhere: CI has none): our model's
logits are transformers' within each dtype's tolerance, and greedy EAGLE decoding, alone and with
sequences batched together, gives plain greedy decoding's tokens exactly, over the captured CUDA
graph steps the GPU runs by default and, in fp32, as the eager steps do."""

import pytest
import torch

from conftest import ours_from_hf, tiny_hf
from test_generate import CharTokenizer
from test_speculative import BOS, GREEDY, LOOKUP, TREE, random_head
from specsot_mq.generate import Generator
from specsot_mq.model import Step
from specsot_mq.sampling import Sampler
from specsot_mq.speculative import EagleDecoder

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU here")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def on_gpu(dtype: torch.dtype):
    """A tiny random Llama made confident (as test_speculative's base), on the GPU in `dtype`."""
    model = ours_from_hf(tiny_hf("llama"))
    model.lm_head.weight.mul_(20)
    return model.to(device="cuda", dtype=dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_logits_match_transformers_on_the_gpu(dtype):
    hf = tiny_hf("llama").to(device="cuda", dtype=DTYPES[dtype])
    ours = ours_from_hf(tiny_hf("llama")).to(device="cuda", dtype=DTYPES[dtype])
    ids = torch.tensor([[BOS, 5, 6, 7, 8, 9, 10, 11]], device="cuda")
    with torch.inference_mode():
        want = hf(ids).logits.float()
        got = ours(ids, ours.new_cache(1, 16), Step.fresh(torch.arange(ids.shape[1], device="cuda")[None])).logits.float()
    tol = 1e-4 if dtype == "fp32" else 5e-2
    assert torch.allclose(got, want, atol=tol, rtol=tol), (got - want).abs().max()


@pytest.mark.parametrize("tree", [TREE, LOOKUP], ids=["tree", "tree+lookup"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_greedy_eagle_equals_plain_greedy_on_the_gpu(dtype, tree):
    base = on_gpu(DTYPES[dtype])
    head = random_head(base).to(device="cuda", dtype=DTYPES[dtype])
    prompts = [[BOS, 5, 6, 7, 8, 9], [BOS, 12], [BOS, 40, 41, 42]]
    gen = Generator(base, CharTokenizer(), max_len=64, num_slots=3)
    decoder = lambda: EagleDecoder(base, head, gen.slots, Sampler(GREEDY, base.device), tree)  # noqa: E731
    plain = [gen.generate(p, GREEDY).token_ids for p in prompts]
    alone = [gen.generate(p, GREEDY, decoder=decoder()).token_ids for p in prompts]
    together = [c.token_ids for c in gen.generate_many(prompts, GREEDY, decoder=decoder())]
    assert alone == plain
    assert together == plain


def test_captured_steps_give_the_eager_steps_tokens_in_fp32(monkeypatch):
    """On the GPU the decoders' steps replay CUDA graphs (cuda_graphs.py); in fp32 greedy decoding
    over them, plain and EAGLE, gives the eager steps' tokens (SPECSOT_CUDA_GRAPHS=0, what
    --no-cuda-graphs sets), and the graphs were captured and replayed."""
    base = on_gpu(torch.float32)
    head = random_head(base).to(device="cuda", dtype=torch.float32)
    prompts = [[BOS, 5, 6, 7, 8, 9], [BOS, 12], [BOS, 40, 41, 42]]

    def run():
        gen = Generator(base, CharTokenizer(), max_len=64, num_slots=3)
        eagle = EagleDecoder(base, head, gen.slots, Sampler(GREEDY, base.device), TREE)
        tokens = [c.token_ids for c in gen.generate_many(prompts, GREEDY)]
        return gen, tokens, [c.token_ids for c in gen.generate_many(prompts, GREEDY, decoder=eagle)]

    captured, plain, eagle = run()
    monkeypatch.setenv("SPECSOT_CUDA_GRAPHS", "0")
    eager, plain_eager, _ = run()
    assert eager.cache.graphs is None
    assert sum(e.replays for e in captured.cache.graphs.values()) > 0
    assert plain == plain_eager and eagle == plain_eager
