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
from specsot_mq.quant import native
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
    """Bit for bit where the native kernels run attention (each row's sums over its visible keys
    alone); torch's attention over a bucket's extra (masked) keys may round the last bit apart."""
    return torch.equal(a, b) if native() is not None else torch.allclose(a, b, rtol=1e-5, atol=1e-6)


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
