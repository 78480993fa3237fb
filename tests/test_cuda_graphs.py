"""Captured steps (cuda_graphs.py) without a GPU: on a CPU the same bucketed, tensor-indexed
forward runs uncaptured, so its padding, buckets and cache writes are checked here against the
eager forward; tests/test_cuda.py checks the captured graphs themselves where there is a GPU."""

import pytest
import torch

from conftest import ours_from_hf, tiny_hf
from test_generate import CharTokenizer
from test_speculative import BOS, GREEDY, LOOKUP, TREE, random_head
from specsot_mq import cuda_graphs
from specsot_mq.generate import Generator
from specsot_mq.model import Step
from specsot_mq.sampling import Sampler
from specsot_mq.speculative import EagleDecoder


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    m = ours_from_hf(tiny_hf("llama"))
    m.lm_head.weight.mul_(20)
    return m


def both(model, slots=4, capacity=64):
    return model.new_cache(slots, capacity), model.new_cache(slots, capacity, graphs=True)


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal up to the last bits: a bucket pads a step's rows, and this model's linears are
    torch's fp32 matmuls, which may take another kernel for another number of rows and round
    apart (seen on a 2-core AMD EPYC, AVX-512: a logit 1.3744 against 1.3743 in this test's draft
    tree step); padding that reached a sequence's entries or rows would be far off."""
    return torch.allclose(a, b, rtol=1e-5, atol=1e-6)


def test_bucketed_steps_equal_eager_steps_and_padding_touches_no_sequence(model):
    eager, static = both(model)
    assert static.num_slots == eager.num_slots == 4 and static.capacity == eager.capacity
    with torch.inference_mode():
        ids = torch.randint(3, 90, (3, 5))
        for cache in (eager, static):  # three prompts of 5 tokens, with hidden states asked
            out = model(ids, cache, Step([0, 1, 3], [0, 0, 0], torch.arange(5).expand(3, 5), hidden_layers=(1, 2)))
            if cache is eager:
                want = out
        assert same(out.logits, want.logits) and all(map(same, out.hidden, want.hidden))
        # a draft-tree verify of two rows in other slots, at other starts, with logits for some rows
        mask = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool).expand(2, 3, 3)
        step = Step([3, 0], [5, 5], torch.tensor([[5, 6, 6], [5, 6, 6]]), mask, logit_rows=[0, 2, 4])
        tree = torch.randint(3, 90, (2, 3))
        want, got = model(tree, eager, step), model(tree, static, step)
        assert same(got.logits, want.logits) and got.logits.shape == (3, 97)
        # one decode token for one row
        step = Step([1], [5], torch.tensor([[5]]))
        want, got = model(torch.tensor([[7]]), eager, step), model(torch.tensor([[7]]), static, step)
        assert same(got.logits, want.logits)
    assert set(static.graphs) == {(4, 16, 128, (1, 2)), (2, 4, 128, ()), (1, 1, 128, ())}  # keys: all there are
    # every sequence's entries are as the eager steps left them (slots 0 and 3 hold 8, slot 1 holds 6)
    for slot, n in ((0, 8), (1, 6), (3, 8)):
        assert same(static.k[:, slot, :, :n], eager.k[:, slot, :, :n])
    assert static.graphs[(1, 1, 128, ())].replays == 1
    assert static.graphs[(4, 16, 128, (1, 2))].inputs.shape == (4, 2 * 16 + 2)


def test_steps_outside_every_bucket_run_eagerly(model):
    cache = model.new_cache(2, 256, graphs=True)
    long = Step.fresh(torch.arange(100)[None])
    assert cuda_graphs.shape_key(model, cache, torch.zeros(1, 100, dtype=torch.long), long) is None  # a long prefill
    early = Step.fresh(torch.arange(4)[None], logit_rows=[], hidden_layers=(1,))
    assert cuda_graphs.shape_key(model, cache, torch.zeros(1, 4, dtype=torch.long), early) is None  # a router's
    plain = model.new_cache(2, 256)
    assert plain.graphs is None and plain.spare == (0, 0)
    assert [cuda_graphs.bucket(n) for n in (1, 2, 3, 5, 64)] == [1, 2, 4, 8, 64]
    assert [cuda_graphs.bucket(n, base=4) for n in (1, 2, 5, 17)] == [1, 4, 16, 64]
    assert cuda_graphs.bucket(3, 256) == 256 and cuda_graphs.bucket(300, 256) == 512


def test_graphs_are_off_on_a_cpu_and_with_the_flag(monkeypatch):
    monkeypatch.delenv("SPECSOT_CUDA_GRAPHS", raising=False)
    assert not cuda_graphs.wanted("cpu")
    assert cuda_graphs.wanted("cuda")
    monkeypatch.setenv("SPECSOT_CUDA_GRAPHS", "0")  # what --no-cuda-graphs sets
    assert not cuda_graphs.wanted("cuda:0")


@pytest.mark.parametrize("tree", [None, TREE, LOOKUP], ids=["plain", "tree", "tree+lookup"])
def test_greedy_generation_over_bucketed_steps_equals_eager(model, tree, monkeypatch):
    prompts = [[BOS, 5, 6, 7, 8, 9], [BOS, 12], [BOS, 40, 41, 42]]

    def generate():
        gen = Generator(model, CharTokenizer(), max_len=64, num_slots=3)
        if tree is None:
            return gen, [c.token_ids for c in gen.generate_many(prompts, GREEDY)]
        head = random_head(model)
        decoder = EagleDecoder(model, head, gen.slots, Sampler(GREEDY, model.device), tree)
        return gen, [c.token_ids for c in gen.generate_many(prompts, GREEDY, decoder=decoder)]

    _, want = generate()
    monkeypatch.setattr(cuda_graphs, "wanted", lambda device: True)
    gen, got = generate()
    assert got == want
    assert gen.cache.graphs and sum(e.replays for e in gen.cache.graphs.values()) > 0


FUSED_CHECK = """
import json, sys
sys.path.insert(0, "tests")
import torch
from conftest import ours_from_hf, tiny_hf
from test_generate import CharTokenizer
from test_speculative import BOS, GREEDY, TREE, random_head
from specsot_mq import cuda_graphs, cuda_kernels
from specsot_mq.generate import Generator
from specsot_mq.model import Step
from specsot_mq.sampling import Sampler
from specsot_mq.speculative import EagleDecoder

torch.manual_seed(0)
model = ours_from_hf(tiny_hf("llama"))
model.lm_head.weight.mul_(20)
eager, static = model.new_cache(4, 64), model.new_cache(4, 64, graphs=True)
mask = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool).expand(2, 3, 3)
steps = [(torch.randint(3, 90, (3, 5)), Step([0, 1, 3], [0, 0, 0], torch.arange(5).expand(3, 5), hidden_layers=(1,))),
         (torch.randint(3, 90, (2, 3)), Step([3, 0], [5, 5], torch.tensor([[5, 6, 6], [5, 6, 6]]), mask))]
gap = 0.0
with torch.inference_mode():
    for ids, step in steps:
        want, got = model(ids, eager, step), model(ids, static, step)
        gap = max(gap, (want.logits - got.logits).abs().max().item())
    for slot, n in ((0, 8), (1, 5), (3, 8)):
        gap = max(gap, (static.kv[:, :, slot, :, :n] - eager.kv[:, :, slot, :, :n]).abs().max().item())
prompts = [[BOS, 5, 6, 7, 8, 9], [BOS, 12], [BOS, 40, 41, 42]]
runs = {}
for graphs in (False, True):
    cuda_graphs.wanted = lambda device, on=graphs: on
    gen = Generator(model, CharTokenizer(), max_len=64, num_slots=3)
    eagle = EagleDecoder(model, random_head(model), gen.slots, Sampler(GREEDY, model.device), TREE)
    runs[graphs] = ([c.token_ids for c in gen.generate_many(prompts, GREEDY)],
                    [c.token_ids for c in gen.generate_many(prompts, GREEDY, decoder=eagle)])
print(json.dumps({"available": cuda_kernels.available(torch.device("cpu")), "gap": gap,
                  "plain_same": runs[True][0] == runs[False][0], "eagle_same": runs[True][1] == runs[True][0]}))
"""


def test_fused_kernels_compute_what_the_torch_ops_do():
    """cuda_kernels' Triton kernels, run by Triton's interpreter on this CPU (a GPU compiles them),
    against the same captured-step forward in torch ops: the logits and cache entries within
    float32 rounding, and greedy decoding, plain and EAGLE, the same tokens."""
    pytest.importorskip("triton", reason="Triton is not installed here: the fused kernels run on a GPU")
    import json
    import os
    import subprocess
    import sys

    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, "-c", FUSED_CHECK], capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["available"]
    assert result["gap"] < 1e-3
    assert result["plain_same"] and result["eagle_same"]
