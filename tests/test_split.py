"""A model split by layers (split.py) computes what the whole model computes: each forward's logits
and hidden states bit for bit (module by module, and in the native kernels' one call per range),
and greedy decoding, plain and with an EAGLE head reading layers from several ranges, token for
token; layer_ranges sizes the ranges by memory."""

import pytest
import torch

from conftest import ours_from_hf, tiny_hf
from test_generate import CharTokenizer
from specsot_mq import quant
from specsot_mq.draft import DraftConfig, DraftHead
from specsot_mq.errors import SpecSotError
from specsot_mq.generate import Generator
from specsot_mq.model import Step
from specsot_mq.sampling import SamplingParams
from specsot_mq.speculative import TreeParams
from specsot_mq.split import SplitModel, layer_ranges, split_layers

GREEDY = SamplingParams(max_tokens=24, ignore_eos=True)
BOUNDS = [(0, 1), (1, 3), (3, 4)]


def model(quantized: bool):
    m = ours_from_hf(tiny_hf("llama", num_hidden_layers=4, intermediate_size=128, vocab_size=112))  # native-kernel sizes
    m.lm_head.weight.mul_(20)  # confident, so drafts get accepted as with a real model
    if quantized:
        names = [f"layers.{i}.{n}" for i in range(4) for n in ("qkv", "o", "gate_up", "down")]
        m.use_quantized({n: quant.quantize(m.get_submodule(n).weight.detach(), "Q4_1") for n in names}, torch.float32)
    return m


@pytest.mark.parametrize("quantized", [False, True], ids=["modules", "native"])
def test_a_split_forward_gives_the_whole_models_bits(quantized):
    whole = model(quantized)
    split = SplitModel(split_layers(whole, BOUNDS))
    with torch.no_grad():  # the native kernels run inference only
        assert split.attends_in_place(split.new_cache(1, 4)) == whole.attends_in_place(whole.new_cache(1, 4)) == quantized
    ids = torch.tensor([[1, 8, 15, 16, 23], [1, 4, 2, 42, 9]])
    layers = (0, 1, 2, 3, 4)  # embeddings, each range's edges, after the final norm

    def run(m):
        cache = m.new_cache(2, 16, torch.float32)
        with torch.no_grad():
            first = m(ids, cache, Step.fresh(torch.arange(5).expand(2, 5), hidden_layers=layers))
            step = m(torch.tensor([[7], [3]]), cache, Step([0, 1], [5, 5], torch.tensor([[5], [5]])))
            early = m(ids, m.new_cache(2, 16, torch.float32), Step.fresh(torch.arange(5).expand(2, 5), logit_rows=[],
                                                                         hidden_layers=(2,)))  # fmt: skip
        return [first.logits, *first.hidden, step.logits, *early.hidden]

    for a, b in zip(run(whole), run(split)):
        assert torch.equal(a, b)


@pytest.mark.parametrize("quantized", [False, True], ids=["modules", "native"])
def test_greedy_over_a_split_model_equals_the_whole_model(quantized):
    """Plain decoding of several prompts at once, and EAGLE with a head that reads hidden states
    held by two different ranges, over the split model: the whole model's tokens."""
    whole = model(quantized)
    split = SplitModel(split_layers(whole, BOUNDS))
    prompts = [[1, 5, 6, 7, 8, 9], [1, 12], [1, 40, 41, 42]]
    want = [c.token_ids for c in Generator(whole, CharTokenizer(), max_len=64, num_slots=3).generate_many(prompts, GREEDY)]
    plain = Generator(split, CharTokenizer(), max_len=64, num_slots=3).generate_many(prompts, GREEDY)
    assert [c.token_ids for c in plain] == want
    torch.manual_seed(0)
    head = DraftHead(DraftConfig.for_base(whole.cfg, 50, (1, 3, 4)))
    head.d2t.copy_(torch.randperm(whole.cfg.vocab_size)[:50])
    head = head.attach(split).eval().requires_grad_(False)
    eagle = Generator(split, CharTokenizer(), max_len=64, num_slots=3, draft=head, tree=TreeParams(4, 2, 2))
    done = eagle.generate_many(prompts, GREEDY)
    assert [c.token_ids for c in done] == want


def test_layer_ranges_follow_the_memory_budgets():
    mb = 2**20
    assert layer_ranges(30, 10 * mb, [300 * mb, 300 * mb]) == [(0, 15), (15, 30)]
    assert layer_ranges(30, 10 * mb, [400 * mb, 200 * mb]) == [(0, 20), (20, 30)]
    # the embedding takes room on the first device, the output layer on the last
    assert layer_ranges(30, 10 * mb, [300 * mb, 300 * mb], embed_bytes=100 * mb) == [(0, 12), (12, 30)]
    small = layer_ranges(4, mb, [1e9, 1e9, 1.5 * mb])  # a small device last: one layer, the rest split
    assert small[-1] == (3, 4) and sorted(b - a for a, b in small[:2]) == [1, 2]
    ranges = layer_ranges(7, mb, [5 * mb, 5 * mb, 5 * mb])
    assert [b - a for a, b in ranges] in ([3, 2, 2], [2, 3, 2], [2, 2, 3]) and ranges[-1][1] == 7
    with pytest.raises(SpecSotError, match="'s 15 layers need 150 MB, more than its memory budget .100 MB.: add a device"):
        layer_ranges(30, 10 * mb, [100 * mb, 100 * mb], names=["10.0.0.1#0", "10.0.0.2#0"])
    with pytest.raises(SpecSotError, match="a split needs 1 to 4 devices"):
        layer_ranges(4, mb, [mb] * 5)


def test_bad_ranges_are_refused():
    with pytest.raises(SpecSotError, match=r"layer ranges \[\(0, 1\), \(2, 4\)\] must cover layers 0 to 4 in order"):
        split_layers(model(False), [(0, 1), (2, 4)])


@pytest.mark.slow  # the real tokenizer comes with the default model
def test_the_sot_engine_over_a_split_model_answers_as_over_the_whole(default_model_dir):
    """Skeleton, then the points decoded together from one shared prefix (copied within every
    range's cache, kept in and restored from the prefix store as every layer's snapshot): the same
    events as over the whole model."""
    from specsot_mq.sot.engine import SoTEngine
    from specsot_mq.sot.flow import SoTConfig
    from specsot_mq.sot.parser import Plan, Point
    from specsot_mq.tokenizer import load_tokenizer

    tok = load_tokenizer(default_model_dir)
    whole = ours_from_hf(tiny_hf("llama", vocab_size=len(tok), max_position_embeddings=1024, num_hidden_layers=3))
    split = SplitModel(split_layers(whole, [(0, 2), (2, 3)]))
    params = SamplingParams(max_tokens=16, ignore_eos=True)

    plan = Plan("plan", [Point(1, "Warm up"), Point(2, "Pick shoes", 80), Point(3, "Start slowly")])

    def answer(m):
        gen = Generator(m, tok, max_len=512, num_slots=4)
        engine = SoTEngine(gen, SoTConfig(sot="always", max_parallel=4, point_tokens=10))
        asked = engine.generate("How do I start running?", params)  # its skeleton from the stored instructions
        points = [(type(e).__name__, getattr(e, "index", None), e.token_ids.tolist()) for e in
                  engine.expand("How do I start running?", plan, params) if hasattr(e, "token_ids")]  # fmt: skip
        return asked.skeleton, asked.answer, points

    got, want = answer(split), answer(whole)
    assert got == want and {i for _, i, ids in want[2] if i and ids} == {1, 2, 3}  # every point wrote
