"""EAGLE speculative decoding through the one loop: greedy output is plain greedy output token for
token (with a useless head and with one that is almost always right), sequences batched together
equal each alone, the accepted path is compacted in place, seeded sampling reproduces, and the
tree flags are checked."""

import pytest
import torch

from conftest import ours_from_hf, tiny_hf
from test_generate import CharTokenizer
from test_tree import chi_square_p
from specsot_mq.draft import DraftConfig, DraftHead
from specsot_mq.errors import SpecSotError
from specsot_mq.generate import Generator, Job, PlainDecoder
from specsot_mq.kv_cache import KVCache
from specsot_mq.model import Step
from specsot_mq.sampling import Sampler, SamplingParams
from specsot_mq.sequence import Sequence
from specsot_mq.slots import SlotManager
from specsot_mq.speculative import EagleDecoder, SpeedChooser, TreeParams

BOS = 1  # every prompt here starts with it, as chat prompts do


class OracleHead:
    """A stand-in draft head whose draft logits are the base model's own, computed on
    [BOS] + the draft's tokens: its top child is the base's greedy choice, so whole paths get
    accepted. It keeps the base's keys and values in a private cache shifted by one entry (BOS
    first) and uses the decoder's draft cache only for its lengths."""

    def __init__(self, base):
        self.base = base
        self.cfg = DraftConfig.for_base(base.cfg, base.cfg.vocab_size)
        self.d2t = torch.arange(base.cfg.vocab_size)

    def new_cache(self, num_slots, capacity, graphs=None):  # (graphs: never captured, as on a CPU)
        self.kv = self.base.new_cache(num_slots, capacity + 1, graphs=False)
        return KVCache(1, num_slots, 1, capacity, 1)  # a stand-in: the private cache holds the entries

    def __call__(self, tokens, features, cache, step):
        b, t = tokens.shape
        for s, start in zip(step.slots, step.starts):
            if start == 0:
                self.base(torch.tensor([[BOS]]), self.kv, Step([s], [0], torch.tensor([[0]])))
        mask = step.mask
        if mask is not None and mask.shape[-1] != t:  # [B, T, K] over the cache: BOS is visible too
            mask = torch.cat([torch.ones(b, t, 1, dtype=torch.bool), mask], dim=-1)
        shifted = Step(step.slots, [n + 1 for n in step.starts], step.positions + 1, mask, step.logit_rows)
        return torch.zeros(b, t, self.base.cfg.hidden_size), self.base(tokens, self.kv, shifted).logits


@pytest.fixture(scope="module")
def base():
    """A tiny random model made confident (its output layer scaled up: top probability ~0.6 instead
    of ~0.02), so a good draft's trees grow deep as with a real model."""
    model = ours_from_hf(tiny_hf("llama"))
    model.lm_head.weight.mul_(20)
    return model


def random_head(base, seed=0, layers=None):
    """An untrained head over a draft vocabulary of 50 of the 97 base tokens (shuffled), so some
    base tokens can never be drafted; `layers`: the base hidden states it reads (default: the
    final one; several give an EAGLE-3-style head that fuses them)."""
    torch.manual_seed(seed)
    head = DraftHead(DraftConfig.for_base(base.cfg, 50, layers))
    head.d2t.copy_(torch.randperm(base.cfg.vocab_size)[:50])
    return head.attach(base).eval().requires_grad_(False)


def started(decoder, prompts: dict[int, list[int]], shared: int = 0) -> list[Sequence]:
    """Prompts started in the slots named, through the decoder's one start path."""
    seqs = [Sequence(slot, Job(slot, p, GREEDY)) for slot, p in prompts.items()]
    decoder.start(seqs, shared)
    return seqs


def heads(base):
    return {"random": random_head(base), "fused": random_head(base, layers=FUSED), "oracle": OracleHead(base)}


FUSED = (0, 1, 2)  # embeddings, layer 1 and the final hidden state of the 2-layer base
GREEDY = SamplingParams(max_tokens=40, ignore_eos=True)
# A branching tree, larger and deeper than the default, so tree drafting and verification are
# what these tests check (every step drafts: no SpeedChooser); no prompt lookup (LOOKUP adds it).
TREE = TreeParams(num_draft_tokens=12, depth=5, topk=4, lookup=0, adaptive=False)
# The same with prompt lookup: chains copied from earlier in the sequence grafted onto each tree.
LOOKUP = TreeParams(num_draft_tokens=12, depth=5, topk=4, lookup=6, adaptive=False)
# A chain of guesses (top-k 1: draft()'s greedy chain, its levels causal, no search).
CHAIN = TreeParams(num_draft_tokens=4, depth=4, topk=1, lookup=0, adaptive=False)


@pytest.mark.parametrize("tree", [TREE, LOOKUP, CHAIN], ids=["tree", "tree+lookup", "chain"])
@pytest.mark.parametrize("kind", ["random", "fused", "oracle"])
def test_greedy_speculative_equals_plain_greedy(base, kind, tree):
    prompt = [BOS, 5, 6, 7, 8]
    gen = Generator(base, CharTokenizer(), max_len=len(prompt) + 40)  # the trees must shrink at the end
    plain = gen.generate(prompt, GREEDY)
    decoder = EagleDecoder(base, heads(base)[kind], gen.slots, Sampler(GREEDY), tree)
    spec = gen.generate(prompt, GREEDY, decoder=decoder)
    assert spec.token_ids == plain.token_ids and spec.finish_reason == "length"
    stats = decoder.stats
    assert stats.steps == spec.steps and stats.drafted > 0
    if kind == "oracle":
        assert stats.tau > 1.5 and stats.accepted_at_depth[2] > 0  # whole paths, so compaction ran
    assert sum(stats.accepted_at_depth) == stats.accepted
    # The tiny model soon repeats itself, so lookup gets tokens accepted that the tree had not
    # drafted (past the oracle's depth too).
    assert (stats.lookup_accepted > 0) == (tree.lookup > 0)


class Scripted:
    """A chooser that runs the ways in a fixed cycle, whatever they measure."""

    def __init__(self, ways):
        self.ways, self.at = ways, 0

    def pick(self, size):
        self.at += 1
        return self.ways[self.at % len(self.ways)]

    def record(self, way, seconds, tokens, size):
        pass


@pytest.mark.parametrize("kind", ["fused", "oracle"])
def test_switching_ways_of_speculating_between_steps_keeps_greedy_output(base, kind):
    """Steps that draft with the head, use prompt lookup alone or do not speculate, in turns and
    runs (so the head reads what plain steps decided late, up to unread_limit steps late), decode
    what plain greedy decoding does, one sequence or three together."""
    prompts = [[BOS, 5, 6, 7, 8], [BOS, 12], [BOS, 40, 41, 42]]
    gen = Generator(base, CharTokenizer(), max_len=64, num_slots=3)
    want = [c.token_ids for c in gen.generate_many(prompts, GREEDY)]
    cycle = ["eagle", "plain", "plain", "lookup", "eagle", "eagle", "lookup", "plain"]
    for script in (cycle, ["plain"] * 20 + ["eagle"] * 40):
        decoder = EagleDecoder(base, heads(base)[kind], gen.slots, Sampler(GREEDY), TreeParams(4, 2, 2, lookup=3))
        decoder.unread_limit = 6
        decoder.chooser = Scripted(script)
        assert [c.token_ids for c in gen.generate_many(prompts, GREEDY, decoder=decoder)] == want
        assert gen.generate(prompts[0], GREEDY, decoder=decoder).token_ids == want[0]


def test_the_chooser_runs_the_fastest_way_and_tries_the_others_less_and_less_often():
    chooser = SpeedChooser(["eagle", "lookup", "plain"])
    cost = {"eagle": (5.0, 2), "lookup": (4.0, 1), "plain": (3.0, 1)}  # seconds, tokens a step: 2.5, 4, 3 a token

    def run(steps, size=1):
        ran = []
        for _ in range(steps):
            ran.append(chooser.pick(size))
            chooser.record(ran[-1], *cost[ran[-1]], size)
        return ran

    ran = run(2000, size=2)
    assert ran[:12] == ["eagle"] * 4 + ["lookup"] * 4 + ["plain"] * 4  # each tried first
    assert ran[12:64] == ["eagle"] * 52
    tries = [i for i in range(1, len(ran)) if ran[i] == "lookup" and ran[i - 1] != "lookup"]
    gaps = [b - a for a, b in zip(tries, tries[1:])]
    assert tries[:2] == [4, 64] and gaps[1:] == [64, 128, 256, 512, 512]  # backing off, up to max_gap
    assert ran[1000:].count("eagle") >= 1000 - 2 * 2 * 4  # the others: a try each per max_gap steps at most
    cost["plain"] = (1.0, 1)  # the batch, the CPU or the text changed: plain steps got cheap
    ran = run(SpeedChooser.max_gap + 200, size=2)
    assert chooser.best(2) == "plain" and ran[-100:].count("plain") >= 100 - 2 * 4  # seen at plain's next try
    # Each batch size learns on its own: 4 sequences together try every way first.
    assert [chooser.pick(4) for _ in range(3)] == ["eagle"] * 3 and chooser.best(2) == "plain"
    assert SpeedChooser(["eagle"]).pick() == "eagle"


def test_one_sequence_takes_lookup_rather_than_plain_where_lookup_is_a_way():
    """A lookup step without a guess is a plain step: one sequence alone never runs plain where
    lookup can run, however its timings fall; batches still weigh all three ways."""
    chooser = SpeedChooser(["eagle", "lookup", "plain"])
    cost = {"eagle": (5.0, 1), "lookup": (4.0, 1), "plain": (1.0, 1)}  # plain timed fastest
    ran = []
    for _ in range(1000):
        ran.append(chooser.pick(1))
        chooser.record(ran[-1], *cost[ran[-1]], 1)
    assert "plain" not in ran and chooser.best(1) == "lookup" and ran[-100:].count("lookup") >= 100 - 4
    assert chooser.ways_at(1) == ["eagle", "lookup"] and chooser.ways_at(2) == ["eagle", "lookup", "plain"]
    assert SpeedChooser(["eagle", "plain"]).ways_at(1) == ["eagle", "plain"]  # no lookup: plain stays


def test_the_head_is_retired_once_its_tree_is_no_faster_over_the_sizes_timed_weighted_by_their_steps():
    def chooser(eagle_ms: dict[int, float], steps: dict[int, int] | None = None,
                eagle_steps: int = SpeedChooser.retire_after) -> SpeedChooser:  # fmt: skip
        c = SpeedChooser(["eagle", "lookup", "plain"])
        for size, ms in eagle_ms.items():
            for _ in range((steps or {}).get(size, 1)):
                c.record("lookup", 2.0, 1, size)  # 2 ms a token
            for _ in range(eagle_steps // len(eagle_ms)):
                c.record("eagle", ms, 1, size)
        return c

    assert not chooser({1: 4.0, 3: 2.6}).drafting_pays()  # 2x and 1.3x lookup's: retired
    assert not chooser({1: 2.0}).drafting_pays()  # as fast as lookup, which carries the head's upkeep: retired
    assert chooser({1: 1.6}).drafting_pays()  # faster: kept
    # faster at 3 sequences, slower at 1: it depends on where the steps ran
    assert chooser({1: 2.4, 3: 1.5}, steps={1: 10, 3: 100}).drafting_pays()
    assert not chooser({1: 2.4, 3: 1.5}, steps={1: 200, 3: 10}).drafting_pays()
    assert chooser({1: 4.0}, eagle_steps=SpeedChooser.retire_after - 1).drafting_pays()  # too few steps to tell
    assert SpeedChooser(["eagle"]).drafting_pays()  # nothing else to decode with (a fixed tree, sampling)


def test_greedy_decoding_goes_plain_once_the_head_is_retired_and_sampling_keeps_it(base):
    """A retired head: greedy decoders are plain ones with prompt lookup (the same tokens), for
    the rest of the generator's life; sampling keeps the head. A slot a plain decoder filled holds
    no draft state, so a decoder with the head never starts from it."""
    prefix = [BOS, 7, 7, 8]
    prompts = [prefix + [1], prefix + [2, 3]]
    plain = Generator(base, CharTokenizer(), max_len=64, num_slots=2)
    expected = [c.token_ids for c in plain.generate_many(prompts, GREEDY, shared=len(prefix))]
    gen = Generator(base, CharTokenizer(), max_len=64, num_slots=2, draft=random_head(base))
    assert isinstance(gen.new_decoder(GREEDY), EagleDecoder) and not gen.head_retired
    for size in (1, 2):  # the tree timed at 3x lookup's cost a token, at each batch size
        gen.chooser.record("lookup", 1.0, 1, size)
        for _ in range(SpeedChooser.retire_after):
            gen.chooser.record("eagle", 3.0, 1, size)
    decoder = gen.new_decoder(GREEDY)
    assert isinstance(decoder, PlainDecoder) and decoder.lookup and gen.head_retired
    assert [c.token_ids for c in gen.generate_many(prompts, GREEDY, shared=len(prefix), decoder=decoder)] == expected
    assert all(gen.slots[s].prefix and gen.slots[s].feature is None for s in (0, 1))
    assert gen.slots.find(prefix, [0, 1], True, False) is not None  # plain decoding may start from them...
    assert gen.slots.find(prefix, [0, 1], True, True) is None  # ...one with the head may not
    sampling = SamplingParams(max_tokens=12, temperature=1.0, seed=3, ignore_eos=True)
    sampler = gen.new_decoder(sampling)
    assert isinstance(sampler, EagleDecoder)
    out = gen.generate_many(prompts, sampling, shared=len(prefix), decoder=sampler)
    assert [len(c.token_ids) for c in out] == [12, 12]
    keep = Generator(base, CharTokenizer(), max_len=64, num_slots=2, draft=random_head(base))
    keep.retire_head = False  # (benchmarks/eagle.py: the head itself is measured)
    keep.chooser = gen.chooser
    assert isinstance(keep.new_decoder(GREEDY), EagleDecoder)


def test_a_generator_keeps_one_chooser_for_its_greedy_decoders(base):
    gen = Generator(base, CharTokenizer(), max_len=64, draft=heads(base)["fused"])
    first, second = gen.new_decoder(GREEDY), gen.new_decoder(GREEDY)
    assert first.chooser is second.chooser and first.chooser.ways == ["eagle", "lookup", "plain"]
    sampled = gen.new_decoder(SamplingParams(temperature=1.0, seed=0, max_tokens=8))
    assert sampled.chooser.ways == ["eagle"]  # sampling drafts every step
    fixed = Generator(base, CharTokenizer(), max_len=64, draft=heads(base)["fused"], tree=TREE)
    assert fixed.new_decoder(GREEDY).chooser.ways == ["eagle"]


@pytest.mark.parametrize("tree", [TREE, LOOKUP], ids=["tree", "tree+lookup"])
@pytest.mark.parametrize("kind", ["random", "fused", "oracle"])
def test_sequences_decoded_together_equal_each_alone(base, kind, tree):
    prompts = [[BOS, 5, 6, 7, 8, 9], [BOS, 12], [BOS, 40, 41, 42]]
    gen = Generator(base, CharTokenizer(), max_len=64, num_slots=3)
    head = heads(base)[kind]
    decoder = lambda: EagleDecoder(base, head, gen.slots, Sampler(GREEDY), tree)  # noqa: E731
    alone = [gen.generate(p, GREEDY, decoder=decoder()).token_ids for p in prompts]
    together = gen.generate_many(prompts, GREEDY, decoder=decoder())
    assert [c.token_ids for c in together] == alone
    assert alone == [c.token_ids for c in gen.generate_many(prompts, GREEDY)]  # and plain decoding


def test_trees_shrink_with_the_batch_down_to_plain_steps(base):
    """A verify budget of 6 tokens: one sequence drafts its whole tree of 5 nodes, two draft 2
    each, four draft none (plain steps that never run the head); every output equals plain
    decoding, and a sequence that later runs alone first reads what the plain steps decided, in
    one head forward, then drafts and gets accepted again. A budget smaller than one tree still
    lets one sequence draft the whole tree."""
    gen = Generator(base, CharTokenizer(), max_len=64)
    decoder = EagleDecoder(base, OracleHead(base), gen.slots, Sampler(GREEDY), TreeParams(12, 5, 4, max_batch_tokens=6))
    with torch.inference_mode():
        running = started(decoder, {0: [BOS, 5, 6, 7]})
        assert decoder.draft(running, decoder.budget([0]))[0].size - 1 == 12
    tree = TreeParams(num_draft_tokens=5, depth=5, topk=4, max_batch_tokens=6)
    for n, nodes in ((1, 5), (2, 2), (4, 0)):
        prompts = [[BOS, 5 + i, 6, 7] for i in range(n)]
        gen = Generator(base, CharTokenizer(), max_len=64, num_slots=n)
        decoder = EagleDecoder(base, OracleHead(base), gen.slots, Sampler(GREEDY), tree)
        with torch.inference_mode():
            running = started(decoder, dict(enumerate(prompts)))
            trees = decoder.draft(running, decoder.budget([seq.slot for seq in running]))
            assert [t.size - 1 for t in trees] == [nodes] * n
        decoder = EagleDecoder(base, OracleHead(base), gen.slots, Sampler(GREEDY), tree)
        got = gen.generate_many(prompts, GREEDY, decoder=decoder)
        assert [c.token_ids for c in got] == [c.token_ids for c in gen.generate_many(prompts, GREEDY)]
    # Four sequences, one far longer: once it runs alone, its trees grow back and get accepted.
    gen = Generator(base, CharTokenizer(), max_len=80, num_slots=4)
    head = CountingHead(base)
    decoder = EagleDecoder(base, head, gen.slots, Sampler(GREEDY), tree)
    params = [SamplingParams(max_tokens=m, ignore_eos=True) for m in (40, 4, 4, 4)]
    prompts = [[BOS, 5 + i, 6, 7] for i in range(4)]
    jobs = [Job(i, p, params[i]) for i, p in enumerate(prompts)]
    out = {}
    for key, delta in gen.run(lambda room, js=jobs: [js.pop(0) for _ in range(min(room, len(js)))], decoder):
        out.setdefault(key, []).extend(delta.token_ids)
    assert out[0] == gen.generate(prompts[0], params[0]).token_ids
    assert decoder.stats.accepted > 0
    # The prefill's head pass, then no head forward while four ran; the next one reads every
    # token they decided for the sequence left (one per plain step, at least the 3 of 4 tokens
    # after the prefill's), then it drafts.
    assert head.calls[0][0] == 4 and head.calls[1][0] == 1 and head.calls[1][1] >= 3


def test_steps_that_draft_nothing_let_the_draft_read_at_most_unread_limit_steps_late(base):
    gen = Generator(base, CharTokenizer(), max_len=64, num_slots=4)
    head = CountingHead(base)
    # No prompt lookup: its chains would make a plain step decide more than one token.
    decoder = EagleDecoder(base, head, gen.slots, Sampler(GREEDY), TreeParams(5, 5, 4, max_batch_tokens=6, lookup=0))
    decoder.unread_limit = 3
    prompts = [[BOS, 5 + i, 6, 7] for i in range(4)]  # four at once: no tree fits the budget
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    got = gen.generate_many(prompts, params, decoder=decoder)
    assert [c.token_ids for c in got] == [c.token_ids for c in gen.generate_many(prompts, params)]
    # The prefill's pass, then every third step one forward reads the three steps' tokens.
    assert head.calls == [(4, 4)] + [(4, 3)] * 3


class CountingHead(OracleHead):
    """An OracleHead that records the [B, T] shape of every forward."""

    def __init__(self, base):
        super().__init__(base)
        self.calls = []

    def __call__(self, tokens, *args, **kwargs):
        self.calls.append(tuple(tokens.shape))
        return super().__call__(tokens, *args, **kwargs)


def test_sequences_finishing_early_leave_the_batch(base):
    prompts = [[BOS, 5, 6], [BOS, 9, 10, 11]]
    gen = Generator(base, CharTokenizer(), max_len=64, num_slots=2)
    free = gen.generate_many(prompts, GREEDY)
    gen.eos_ids = frozenset({free[0].token_ids[6]})
    decoder = EagleDecoder(base, OracleHead(base), gen.slots, Sampler(GREEDY), TREE)
    both = gen.generate_many(prompts, SamplingParams(max_tokens=40), decoder=decoder)
    plain = gen.generate_many(prompts, SamplingParams(max_tokens=40))
    assert [c.token_ids for c in both] == [c.token_ids for c in plain]
    assert both[0].finish_reason == "stop" and len(both[0].token_ids) <= 7


def test_accepted_path_is_compacted_in_place(base):
    prompt = [BOS, 20, 21, 22]
    slots = SlotManager(base.new_cache(1, 64))
    cache = slots.cache
    decoder = EagleDecoder(base, OracleHead(base), slots, Sampler(GREEDY), TREE)
    with torch.inference_mode():
        running = started(decoder, {0: prompt})
        first = [running[0].last]
        new = decoder.step(running)[0]
    assert len(new) > 2  # several drafted tokens accepted, plus the bonus
    kept = prompt + first + new[:-1]  # the bonus is the next root: not in the cache yet
    assert slots[0].length == len(kept)
    fresh = base.new_cache(1, 64)
    with torch.inference_mode():
        base(torch.tensor([kept]), fresh, Step.fresh(torch.arange(len(kept))[None]))
    n = len(kept)
    torch.testing.assert_close(cache.k[:, 0, :, :n], fresh.k[:, 0, :, :n], atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(cache.v[:, 0, :, :n], fresh.v[:, 0, :, :n], atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("layers", [None, FUSED])
def test_draft_cache_after_steps_equals_one_fresh_draft_pass(base, layers):
    prompt = [BOS, 30, 31, 32, 33]
    head = random_head(base, seed=3, layers=layers)
    decoder = EagleDecoder(base, head, SlotManager(base.new_cache(1, 64)), Sampler(GREEDY), TREE)
    with torch.inference_mode():
        running = started(decoder, {0: prompt})
        ids = prompt + [running[0].last]
        for _ in range(4):
            ids += decoder.step(running)[0]
        n = len(ids) - 1  # the last token is the root: in neither cache
        decoder.draft_extend(running)  # the draft reads the last step's tokens before its next tree
        assert decoder.slots[0].draft_length == n and not running[0].unread
        layers = head.cfg.feature_layers
        out = base(torch.tensor([ids[:n]]), base.new_cache(1, 64), Step.fresh(torch.arange(n)[None], hidden_layers=layers))
        fresh = head.new_cache(1, 64)
        head(torch.tensor([ids[1 : n + 1]]), torch.cat(out.hidden, -1), fresh, Step.fresh(torch.arange(n)[None]))
    torch.testing.assert_close(decoder.slots.draft.k[:, 0, :, :n], fresh.k[:, 0, :, :n], atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(decoder.slots.draft.v[:, 0, :, :n], fresh.v[:, 0, :, :n], atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("kind", ["random", "oracle"])
def test_seeded_sampling_reproduces(base, kind):
    params = SamplingParams(max_tokens=30, temperature=1.0, top_k=20, seed=7, ignore_eos=True)
    gen = Generator(base, CharTokenizer(), max_len=64, num_slots=2)
    head = heads(base)[kind]
    prompts = [[BOS, 5, 6, 7], [BOS, 50]]

    def run(p):
        decoder = EagleDecoder(base, head, gen.slots, Sampler(p), TREE)
        return [c.token_ids for c in gen.generate_many(prompts, p, decoder=decoder)], decoder.stats

    (a, stats), (b, _) = run(params), run(params)
    other, _ = run(SamplingParams(max_tokens=30, temperature=1.0, top_k=20, seed=8, ignore_eos=True))
    assert a == b and a != other
    if kind == "oracle":  # the draft is the target: nearly every first child is accepted
        assert stats.tau > 2


def test_prompt_lookup_without_a_head_equals_plain_decoding_in_fewer_steps(base):
    """A model without a draft head: the plain decoder feeds the copied tokens along and keeps
    what the model agrees with; alone and batched, the tokens are plain decoding's."""
    prompts = [[BOS, 5, 6, 7, 8, 9], [BOS, 12], [BOS, 40, 41, 42]]
    plain = Generator(base, CharTokenizer(), max_len=160, num_slots=3)
    gen = Generator(base, CharTokenizer(), max_len=160, num_slots=3, tree=TreeParams(lookup=6))
    want = [c.token_ids for c in plain.generate_many(prompts, GREEDY)]
    alone = [gen.generate(p, GREEDY, decoder=gen.new_decoder(GREEDY)) for p in prompts]
    assert [c.token_ids for c in alone] == want
    assert sum(c.steps for c in alone) < sum(len(c.token_ids) - 1 for c in alone)  # copies got accepted
    decoder = gen.new_decoder(GREEDY)
    together = gen.generate_many(prompts, GREEDY, decoder=decoder)
    assert [c.token_ids for c in together] == want
    # Its stats count what lookup drafted and got accepted: each step gave 1 + accepted tokens.
    st = decoder.stats
    assert st.accepted == st.lookup_accepted > 0 and st.tau == together[0].tau > 1
    assert sum(len(c.token_ids) for c in together) <= len(prompts) + st.steps + st.accepted  # + the prefill's
    sampled = SamplingParams(max_tokens=8, temperature=1.0, seed=1)
    assert gen.new_decoder(sampled).lookup == 0 and gen.new_decoder(GREEDY).lookup == 6
    assert gen.new_decoder(sampled).stats is None and plain.new_decoder(GREEDY).stats is None  # no lookup: no tau


def test_prompt_lookup_is_off_when_sampling(base):
    """Lookup is greedy-only (a grafted node has no draft distribution for rejection sampling):
    with it asked for, seeded sampling draws exactly what it draws without."""
    params = SamplingParams(max_tokens=30, temperature=1.0, top_k=20, seed=7, ignore_eos=True)
    gen = Generator(base, CharTokenizer(), max_len=64)
    runs = []
    for tree in (TREE, LOOKUP):
        decoder = EagleDecoder(base, random_head(base), gen.slots, Sampler(params), tree)
        runs.append(gen.generate([BOS, 5, 6, 7], params, decoder=decoder).token_ids)
        assert decoder.stats.lookup_accepted == 0
        with torch.inference_mode():
            seq = started(decoder, {0: [BOS, 5, 6, 7]})[0]
            assert seq.index is None  # no lookup index kept
    assert runs[0] == runs[1]


def test_sampling_through_the_decoder_keeps_the_base_distribution(base):
    """The first speculative token (the one after the prefill's) follows the base distribution,
    as temperature, top-k and min-p shape it, with a head whose draft vocabulary is a shuffled part
    of the base's (chi-square)."""
    prompt, b, rounds = [BOS, 5, 6, 7], 16, 100
    params = SamplingParams(max_tokens=2, temperature=1.5, top_k=12, min_p=0.1, seed=1, ignore_eos=True)
    gen = Generator(base, CharTokenizer(), max_len=32, num_slots=b)
    head, sampler = random_head(base), Sampler(params)
    counts = torch.zeros(base.cfg.vocab_size, dtype=torch.float64)
    for _ in range(rounds):
        decoder = EagleDecoder(base, head, gen.slots, sampler, TreeParams(8, 3, 3, max_batch_tokens=b * 9))
        for done in gen.generate_many([prompt] * b, params, decoder=decoder):
            counts[done.token_ids[1]] += 1
    with torch.inference_mode():  # exact: sum over x of p(x | prompt) p(y | prompt, x)
        v = base.cfg.vocab_size
        first = sampler.probs(base(torch.tensor([prompt]), base.new_cache(1, 8), Step.fresh(torch.arange(4)[None])).logits[:, -1])
        ids = torch.tensor([prompt + [x] for x in range(v)])
        second = sampler.probs(base(ids, base.new_cache(v, 8), Step.fresh(torch.arange(5).expand(v, 5))).logits[:, -1])
    assert 0 < int((first > 0).sum()) < params.top_k  # min-p drops some of top-k's tokens
    expected = b * rounds * (first.double() @ second.double())[0]
    big = expected > 5  # pool the rare tokens into one category
    observed = torch.cat([counts[big], counts[~big].sum()[None]])
    assert chi_square_p(observed, torch.cat([expected[big], expected[~big].sum()[None]])) > 0.01
    assert decoder.stats.accepted > 0


def test_a_fused_head_saved_and_loaded_drafts_as_before(base, tmp_path):
    """An EAGLE-3-style head (three base hidden states fused) keeps its layers and weights
    through its checkpoint (weights stored in bf16, so compared after the same rounding)."""
    head = random_head(base, layers=FUSED)
    for p in head.parameters():
        p.data = p.data.bfloat16().float()
    head.save(tmp_path / "head.safetensors")
    loaded = DraftHead.load(tmp_path / "head.safetensors", base)
    assert loaded.cfg.feature_layers == FUSED and loaded.fuse is not None
    tokens, positions = torch.tensor([[5, 6, 7]]), torch.arange(3)[None]
    feats = torch.randn(1, 3, 3 * base.cfg.hidden_size)
    with torch.inference_mode():
        want = head(tokens, feats, head.new_cache(1, 8), Step.fresh(positions))
        got = loaded(tokens, feats, loaded.new_cache(1, 8), Step.fresh(positions))
        # a deeper draft step reads the head's own prediction (one hidden state wide)
        deeper = loaded(tokens[:, :1], got[0][:, -1:], loaded.new_cache(1, 8), Step.fresh(torch.tensor([[3]])))
    for a, b in zip(want, got):
        torch.testing.assert_close(a, b)
    assert deeper[1].shape == (1, 1, 50)


def test_last_only_forward_still_returns_every_positions_features(base):
    """Prefill needs all features but only the last logits (a fix in model.py: the final norm's
    output used to be cut to the last position, unlike the other hidden states)."""
    step = Step.fresh(torch.arange(4)[None], logit_rows=[3], hidden_layers=(1, base.cfg.num_layers))
    out = base(torch.tensor([[BOS, 3, 4, 5]]), base.new_cache(1, 8), step)
    assert out.logits.shape[0] == 1 and [h.shape[1] for h in out.hidden] == [4, 4]


@pytest.mark.parametrize("layers", [None, FUSED], ids=["eagle1", "fused"])
def test_a_heads_logits_at_chosen_positions_are_those_of_the_full_forward(base, layers):
    """Prefill and draft_extend need the draft logits of each row's newest position only."""
    head = random_head(base, layers=layers)
    tokens, positions = torch.tensor([[3, 4, 5], [6, 7, 8]]), torch.arange(3).expand(2, 3)
    features = torch.randn(2, 3, len(head.cfg.feature_layers) * base.cfg.hidden_size)
    hidden, logits = head(tokens, features, head.new_cache(2, 8), Step.fresh(positions))
    at = torch.tensor([2, 1])
    hidden_at, logits_at = head(tokens, features, head.new_cache(2, 8), Step.fresh(positions, logit_rows=[2, 4]))
    assert torch.equal(hidden_at, hidden) and logits_at.shape == (2, 50)
    # float weights: the matmul may round differently on fewer rows (the quantized kernels do not)
    torch.testing.assert_close(logits_at, logits[torch.arange(2), at])


@pytest.mark.parametrize(
    "kwargs, flag",
    [
        ({"num_draft_tokens": 0}, "--num-draft-tokens"),
        ({"lookup": -1}, "--lookup"),
        ({"depth": 0}, "--draft-depth"),
        ({"topk": -1}, "--draft-topk"),
        ({"topk": 2.5}, "--draft-topk"),
        ({"num_draft_tokens": 40, "depth": 3, "topk": 3}, "more than a tree of --draft-depth 3 and --draft-topk 3"),
        ({"num_draft_tokens": 3, "depth": 5, "topk": 2}, "--draft-depth 5 is deeper"),
    ],
)
def test_impossible_tree_params_are_one_clear_error(kwargs, flag):
    with pytest.raises(SpecSotError, match=flag) as err:
        TreeParams(**kwargs)
    assert "\n" not in str(err.value)


def test_default_tree_fits_a_cheap_cpu_verify():
    tree = TreeParams()  # with its prompt-lookup chain grafted on, a verify stays within 16 tokens
    assert tree.num_draft_tokens + 1 + tree.lookup <= 16 and tree.num_draft_tokens <= tree.max_nodes


@pytest.mark.parametrize("layers", [None, FUSED])
def test_shared_prefix_prefill_fills_both_caches_as_separate_prefills_do(base, layers):
    """Prompts sharing a prefix: the prefix is computed once and copied, yet both caches (and the
    first draft distributions) equal those of prefilling each prompt on its own."""
    head = random_head(base, layers=layers)
    prefix = [BOS, 3, 1, 4, 1, 5]
    prompts = {0: prefix + [9, 2], 1: prefix + [6], 2: prefix + [5, 3, 5]}
    shared = EagleDecoder(base, head, SlotManager(base.new_cache(3, 32)), Sampler(GREEDY), TREE)
    alone = EagleDecoder(base, head, SlotManager(base.new_cache(3, 32)), Sampler(GREEDY), TREE)
    with torch.inference_mode():
        roots = started(shared, prompts, shared=len(prefix))
        want = [started(alone, {s: p})[0] for s, p in prompts.items()]
    assert [seq.last for seq in roots] == [seq.last for seq in want]
    for (s, p), got, one in zip(prompts.items(), roots, want):
        n = len(p)
        assert shared.slots[s].length == n and shared.slots[s].draft_length == n
        for a, b in ((shared.slots.cache, alone.slots.cache), (shared.slots.draft, alone.slots.draft)):
            torch.testing.assert_close(a.k[:, s, :, :n], b.k[:, s, :, :n], atol=1e-5, rtol=1e-4)
            torch.testing.assert_close(a.v[:, s, :, :n], b.v[:, s, :, :n], atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(got.logits, one.logits, atol=1e-4, rtol=1e-4)


def test_shared_prefix_and_admission_with_eagle_equal_plain_decoding(base):
    prefix = [BOS, 7, 7, 8]
    prompts = [prefix + [1], prefix + [2, 3], prefix + [4, 5, 6], prefix + [9]]
    gen = Generator(base, CharTokenizer(), max_len=64, num_slots=2)
    plain = [gen.generate(p, GREEDY).token_ids for p in prompts]
    decoder = EagleDecoder(base, random_head(base), gen.slots, Sampler(GREEDY), TREE)
    spec = gen.generate_many(prompts, GREEDY, decoder=decoder, shared=len(prefix), max_parallel=2)
    assert [c.token_ids for c in spec] == plain


def test_stop_string_ends_speculative_output_where_plain_decoding_ends(base):
    """Several tokens accepted in one step: the output still ends at the token that completes
    the stop string, as with one token per step."""
    prompt = [BOS, 5, 6, 7, 8]
    gen = Generator(base, CharTokenizer(), max_len=64)
    free = gen.generate(prompt, GREEDY).text
    stop = free[10:12]
    params = SamplingParams(max_tokens=40, stop=(stop,), ignore_eos=True)
    plain = gen.generate(prompt, params)
    spec = gen.generate(prompt, params, decoder=EagleDecoder(base, OracleHead(base), gen.slots, Sampler(params), TREE))
    assert spec.token_ids == plain.token_ids and spec.text == plain.text and spec.finish_reason == "stop"


def test_repeat_stop_ends_speculative_output_where_plain_decoding_ends(base):
    """A loop found inside a step's accepted tokens ends the output at the same token as one
    token per step does."""
    prompt = [BOS, 5, 6, 7, 8]
    gen = Generator(base, CharTokenizer(), max_len=64)
    params = SamplingParams(max_tokens=40, ignore_eos=True, repeat_stop=3)
    plain = gen.generate(prompt, params)
    decoder = EagleDecoder(base, OracleHead(base), gen.slots, Sampler(params), TREE)
    spec = gen.generate(prompt, params, decoder=decoder)
    assert plain.finish_reason == "repeat" and len(plain.token_ids) < 40
    assert spec.token_ids == plain.token_ids and spec.finish_reason == "repeat"
    assert decoder.stats.tau > 1.5  # steps did accept several tokens


@pytest.mark.parametrize("kind", ["random", "fused", "oracle"])
def test_jobs_of_several_prefix_groups_joining_a_running_batch_equal_plain_decoding(base, kind):
    """What a serving stage does: points of different requests (different shared prefixes, different
    length caps) are admitted while others run, reusing each other's freed slots; each equals plain
    greedy decoding of its own prompt, and a cancelled job ends with an "abort" delta."""
    from specsot_mq.generate import Job

    gen = Generator(base, CharTokenizer(), max_len=64, num_slots=3)
    groups = {"a": [BOS, 7, 7, 8], "b": [BOS, 3, 9, 9, 2, 5], "c": [BOS, 4]}
    arrivals = [  # (step at which it arrives, job)
        (0, Job("a1", groups["a"] + [1], SamplingParams(max_tokens=9, ignore_eos=True), 4, "a")),
        (0, Job("a2", groups["a"] + [2, 3], SamplingParams(max_tokens=4, ignore_eos=True), 4, "a")),
        (1, Job("b1", groups["b"] + [6], SamplingParams(max_tokens=7, ignore_eos=True), 6, "b")),
        (1, Job("b2", groups["b"] + [11, 12], SamplingParams(max_tokens=5, ignore_eos=True), 6, "b")),
        (2, Job("a3", groups["a"] + [13], SamplingParams(max_tokens=6, ignore_eos=True), 4, "a")),
        (3, Job("c1", groups["c"] + [5], SamplingParams(max_tokens=8, ignore_eos=True), 0, None)),
        (3, Job("x", groups["c"] + [6], SamplingParams(max_tokens=30, ignore_eos=True), 0, None)),
    ]
    step = [0]

    def admit(room):
        ready = [job for at, job in arrivals if at <= step[0]][:room]
        for job in ready:
            arrivals.remove(next(a for a in arrivals if a[1] is job))
        step[0] += 1
        return ready

    head = random_head(base) if kind == "random" else OracleHead(base)
    decoder = EagleDecoder(base, head, gen.slots, Sampler(GREEDY), TREE)
    jobs = {job.key: job for _, job in arrivals}
    got, finish = {key: [] for key in jobs}, {}
    for key, delta in gen.run(admit, decoder, cancelled=lambda key: key == "x" and step[0] > 6):
        got[key] += delta.token_ids
        finish[key] = delta.finish_reason or finish.get(key)
    for key, job in jobs.items():
        if key != "x":
            assert got[key] == gen.generate(job.ids, job.params).token_ids, key
    assert finish["x"] == "abort" and 0 < len(got["x"]) < 30


@pytest.mark.parametrize("kind", ["plain", "random", "oracle"])
def test_a_full_cache_slot_ends_its_output_with_length_after_the_tokens_that_fit(base, kind):
    """Outputs longer than their cache slot has room for end with finish "length" once the slot
    is full (prompt + output - 1 entries: the last token is never fed), with the tokens decoding
    with room to spare gives; each slot by its own room."""
    prompts = [[BOS, 5, 6, 7, 8], [BOS, 12]]
    want = [Generator(base, CharTokenizer(), max_len=128).generate(p, GREEDY).token_ids for p in prompts]
    gen = Generator(base, CharTokenizer(), max_len=24, num_slots=2)
    decoder = (PlainDecoder(base, gen.slots, Sampler(GREEDY)) if kind == "plain"
               else EagleDecoder(base, heads(base)[kind], gen.slots, Sampler(GREEDY), TREE))  # fmt: skip
    done = gen.generate_many(prompts, GREEDY, decoder=decoder)
    for c, p, w in zip(done, prompts, want):
        assert c.finish_reason == "length" and c.token_ids == w[: 24 - len(p) + 1]


@pytest.mark.parametrize("kind", ["random", "oracle"])
def test_a_late_job_near_its_cache_end_catches_the_draft_up_beside_a_row_with_many_unread_tokens(base, kind):
    """The draft reads decided tokens late (steps that draft nothing), each row as many as it has;
    a job admitted later has fewer, and when its slot is nearly full the longest row's count would
    take it past the draft cache's end in one padded forward. Both still decode as plain greedy
    decoding does (the late one to its slot's end)."""
    from specsot_mq.generate import Job

    gen = Generator(base, CharTokenizer(), max_len=64, num_slots=2)
    early = Job("early", [BOS, 5, 6], SamplingParams(max_tokens=45, ignore_eos=True))
    late = Job("late", [BOS] + [7 + i % 30 for i in range(49)], SamplingParams(max_tokens=40, ignore_eos=True))
    arrivals = {0: early, 30: late}
    step = [0]

    def admit(room):
        job = arrivals.pop(step[0], None)
        step[0] += 1
        return [job] if job else []

    decoder = EagleDecoder(base, heads(base)[kind], gen.slots, Sampler(GREEDY), TreeParams(4, 2, 2, lookup=0))
    decoder.chooser = Scripted(["plain"] * 36 + ["eagle"] * 40)  # 36 steps decided, none read by the draft
    got = {"early": [], "late": []}
    for key, delta in gen.run(admit, decoder):
        got[key] += delta.token_ids
    assert got["early"] == gen.generate(early.ids, early.params).token_ids
    assert got["late"] == gen.generate(late.ids, late.params).token_ids[: 64 - len(late.ids) + 1]
