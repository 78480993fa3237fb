"""The same promises on a CUDA GPU, where there is one (skipped elsewhere: CI has none): our model's
logits are transformers' within each dtype's tolerance, and greedy EAGLE decoding, alone and with
sequences batched together, gives plain greedy decoding's tokens exactly."""

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
