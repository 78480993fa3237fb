"""Captured steps (cuda_graphs.py) without a GPU: on a CPU the same bucketed, tensor-indexed
forward runs uncaptured, so its padding, buckets and cache writes are checked here against the
eager forward; tests/test_cuda.py checks the captured graphs themselves where there is a GPU."""

import pytest
import torch

from conftest import ours_from_hf, tiny_hf
from test_generate import CharTokenizer
from test_speculative import BOS, CHAIN, GREEDY, LOOKUP, TREE, random_head
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


@pytest.mark.parametrize("tree", [None, TREE, LOOKUP, CHAIN], ids=["plain", "tree", "tree+lookup", "chain"])
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
    if tree is not None:  # the head's steps (draft_extend's; a chain's levels too) replayed its own buckets
        assert sum(e.replays for e in gen.slots.draft.graphs.values()) > 0
    if tree is CHAIN:  # a level reads the head's own feature, one token a row
        assert any(key[1] == 1 and key[3] == model.cfg.hidden_size for key in gen.slots.draft.graphs)


def test_a_draft_heads_bucketed_steps_equal_its_eager_steps(model):
    """The head's forward over a cache with graphs (cuda_graphs.replay_head): a draft_extend's
    causal step with the newest rows' logits, a one-level tree's [B, T, T] mask over the new
    tokens, and its own predicted features; a tree level's mask over cache entries runs eagerly."""
    head = random_head(model, layers=(0, 1, model.cfg.num_layers))  # base features fused (EAGLE-3 style)
    eager, static = head.new_cache(4, 64), head.new_cache(4, 64, graphs=True)
    assert eager.graphs is None and static.num_slots == 4
    width = len(head.cfg.feature_layers) * model.cfg.hidden_size
    torch.manual_seed(1)
    mask = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool).expand(2, 3, 3)
    steps = [
        (torch.randint(3, 90, (3, 5)), torch.randn(3, 5, width), Step([0, 1, 3], [0, 0, 0], torch.arange(5).expand(3, 5), logit_rows=[4, 9, 14])),
        (torch.randint(3, 90, (2, 3)), torch.randn(2, 3, width), Step([3, 0], [5, 5], torch.tensor([[5, 6, 6], [5, 6, 6]]), mask)),
        (torch.randint(3, 90, (1, 1)), torch.randn(1, 1, model.cfg.hidden_size), Step([1], [5], torch.tensor([[5]]))),
        (torch.randint(3, 90, (1, 2)), torch.randn(1, 2, model.cfg.hidden_size),
         Step([1], [6], torch.tensor([[6, 6]]), torch.ones(1, 2, 8, dtype=torch.bool))),  # a mask over cache entries
    ]
    with torch.inference_mode():
        for tokens, feats, step in steps:
            (h1, l1), (h2, l2) = head(tokens, feats, eager, step), head(tokens, feats, static, step)
            assert same(h2, h1) and same(l2, l1) and l2.shape == l1.shape
    # (keys: the cache holds 64 + 64 spare entries a row, fewer than a bucket's 256)
    assert set(static.graphs) == {(4, 16, 128, width), (2, 4, 128, width), (1, 1, 128, model.cfg.hidden_size)}
    for slot, n in ((0, 8), (1, 8), (3, 8)):  # every sequence's entries as the eager steps left them
        assert same(static.k[:, slot, :, :n], eager.k[:, slot, :, :n])


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
