"""KV shipping (specsot_mq/kv_ship.py): a stored prompt beginning's state sent over the wire to
another generator decodes the tokens recomputing it gives; the parts, the checks, the rule, and
the scheduler's record of who kept what."""

from __future__ import annotations

import pytest
import torch

from conftest import ours_from_hf, tiny_hf
from specsot_mq.errors import SpecSotError
from specsot_mq.generate import Generator, Job
from specsot_mq.kv_ship import Shape, ShipRule, from_parts, to_parts
from specsot_mq.messages import decode, encode
from specsot_mq.prompts import direct_ids
from specsot_mq.sampling import SamplingParams
from specsot_mq.stages.schedule import Holders
from specsot_mq.tokenizer import load_tokenizer

PARAMS = SamplingParams(max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def pair(default_model_dir):
    """Two generators over one tiny model (two devices' stages), each with its own cache and store,
    with and without an EAGLE head."""
    from specsot_mq.draft import DraftConfig, DraftHead
    from specsot_mq.speculative import TreeParams

    tok = load_tokenizer(default_model_dir)
    model = ours_from_hf(tiny_hf("llama", vocab_size=len(tok), max_position_embeddings=1024))
    torch.manual_seed(0)
    head = DraftHead(DraftConfig.for_base(model.cfg, 512)).attach(model).eval().requires_grad_(False)

    def make(draft):
        return Generator(model, tok, max_len=512, num_slots=2, draft=draft, tree=TreeParams(6, 3, 2) if draft else None)

    return {False: (make(None), make(None)), True: (make(head), make(head))}


def run(gen, ids, keep=0):
    jobs = [Job(0, ids, PARAMS, keep=keep)]
    return [t for _, d in gen.run(lambda room: [jobs.pop()] if jobs else [], gen.new_decoder(PARAMS)) for t in d.token_ids]


def layer_bytes(state) -> int:
    """One layer's keys and values: a part of that size carries one layer."""
    return 2 * state.kv[0][0].numel() * state.kv[0].element_size()


def over_the_wire(parts):
    """The parts as the receiving stage gets them: encoded to frames and decoded."""
    return [decode([bytes(f) for f in encode(p, "branch@b", "branch@a")]).msg for p in parts]


@pytest.mark.parametrize("eagle", [False, True])
def test_shipped_kv_decodes_the_tokens_recomputing_gives(pair, eagle, monkeypatch):
    """Device A decodes a conversation's first turn and keeps it; its state, shipped to device B
    in parts through the wire codec, lets B's next turn compute only the new tokens, and B decodes
    exactly what it decodes recomputing the whole prompt."""
    a, b = pair[eagle]
    tok = a.tokenizer
    turn1 = direct_ids(tok, "Tell me about Rome.")
    history = [{"role": "user", "content": "Tell me about Rome."}, {"role": "assistant", "content": "It is old."}]
    turn2 = direct_ids(tok, "Name two colors.", history)
    want = run(b, turn2)  # recomputed whole: B holds nothing of it
    assert turn1 not in b.prefixes
    run(a, turn1, keep=len(turn1))
    entry = a.prefixes.longest(turn2[:-1], whole=True, count=False)
    assert entry.ids == turn1
    parts = over_the_wire(to_parts("r1", entry.state, len(turn1), part_bytes=layer_bytes(entry.state)))
    assert len(parts) > 1 and all(p.tokens == len(turn1) for p in parts) and bool(parts[-1].draft) == eagle
    state = from_parts(parts, Shape.of(b))
    assert torch.equal(state.kv[0], entry.state.kv[0]) and torch.equal(state.kv[1], entry.state.kv[1])
    b.prefixes.add(turn1, state)
    widths, forward = [], type(b.model).forward
    monkeypatch.setattr(type(b.model), "forward", lambda self, x, *args, **kw: widths.append(tuple(x.shape)) or forward(self, x, *args, **kw))
    assert run(b, turn2) == want
    assert widths[0] == (1, len(turn2) - len(turn1))  # only the new turn was computed


def test_parts_that_do_not_fit_the_receiver_are_refused_by_name(pair):
    a, b = pair[False]
    ids = direct_ids(a.tokenizer, "Why is the sky blue?")
    run(a, ids, keep=len(ids))
    entry = a.prefixes.longest(ids, whole=True, count=False)
    parts = to_parts("r", entry.state, len(ids), part_bytes=layer_bytes(entry.state))
    with pytest.raises(SpecSotError, match="one whole"):
        from_parts(parts[1:], Shape.of(b))
    with pytest.raises(SpecSotError, match="draft head's state"):
        from_parts(parts, Shape.of(pair[True][1]))  # a receiver with a head needs its state too
    shape = Shape.of(b)
    shape.base = (shape.base[0] + 1, *shape.base[1:])
    with pytest.raises(SpecSotError, match="same model"):
        from_parts(parts, shape)
    with pytest.raises(SpecSotError, match="over a part"):
        to_parts("r", entry.state, len(ids), part_bytes=8)


def test_the_rule_ships_where_the_measured_link_beats_the_measured_prefill():
    rule = ShipRule()
    assert not rule.measured("b")
    rule.record("b", 100_000_000, 0.101, empty_seconds=0.001)  # 100 MB in 0.1 s past a 1 ms round trip
    assert rule.measured("b") and rule.bandwidth["b"] == pytest.approx(1e9)
    ship, ship_s, recompute_s = rule.decide("b", 50_000_000, 1000, 0.001)  # 51 ms to ship, 1 s to recompute
    assert ship and ship_s == pytest.approx(0.051) and recompute_s == pytest.approx(1.0)
    ship, _, _ = rule.decide("b", 50_000_000, 20, 0.001)  # 20 ms to recompute: cheaper
    assert not ship
    assert rule.decide("b", 1000, 20, None)[0]  # recomputing not timed yet: ship
    rule.record("b", 100_000_000, 0.201)  # a slower transfer moves the estimate halfway
    assert rule.bandwidth["b"] == pytest.approx((1e9 + 0.5e9) / 2)


def test_the_scheduler_knows_which_stage_kept_the_longest_beginning():
    holders = Holders(limit=3)
    holders.add([1, 2, 3], "branch@a")
    holders.add([1, 2, 3, 4, 5], "branch@b")
    assert holders.longest([1, 2, 3, 4, 5, 6]) == ("branch@b", 5)
    assert holders.longest([1, 2, 3, 4, 9]) == ("branch@a", 3)
    assert holders.longest([1, 2, 3, 4, 5]) == ("branch@a", 3)  # shorter than the prompt only
    assert holders.longest([7, 8]) is None
    holders.add([1, 2, 3, 4, 5], "branch@a")  # the newest keeper counts
    assert holders.longest([1, 2, 3, 4, 5, 6]) == ("branch@a", 5)
    holders.add([9, 9], "branch@a")
    holders.add([8, 8], "branch@a")  # past the limit the oldest goes
    assert holders.longest([1, 2, 3, 4, 5, 6]) == ("branch@a", 5) and holders.longest([1, 2, 3, 4]) is None


def test_a_generator_times_its_prefills_per_token_computed(pair):
    """The receiver's side of the rule: Decoder.start counts the prompt tokens it computed (a
    stored beginning's not among them, a group's shared prefix once), and the generator's meter
    turns timed prefills of 32 tokens or more into seconds per token."""
    from specsot_mq.sequence import Sequence

    a = pair[False][0]
    gen = Generator(a.model, a.tokenizer, max_len=512, num_slots=3)
    assert gen.prefill.seconds_per_token is None
    gen.time_prefill(64)
    assert gen.prefill.seconds_per_token > 0
    gen.keep_prefix(list(range(100, 120)))  # 20 tokens stored
    decoder = gen.new_decoder(PARAMS)
    alone = Sequence(0, Job(None, list(range(100, 150)), PARAMS))
    assert decoder.start([alone]) == 30  # past the stored 20
    group = [Sequence(s, Job(None, list(range(200, 240)) + [s] * 5, PARAMS)) for s in (1, 2)]
    assert decoder.start(group, shared=40) == 40 + 2 * 5  # the shared 40 once, then each one's own
    meter = type(gen.prefill)()
    meter.add(10, 1.0)  # too short to say what a token costs
    assert meter.seconds_per_token is None
    meter.add(100, 1.0)
    meter.add(100, 2.0)
    assert meter.seconds_per_token == pytest.approx(0.7 * 0.01 + 0.3 * 0.02)
