"""A model split by layers (split.py) computes what the whole model computes: each forward's logits
and hidden states bit for bit (module by module, and in the native kernels' one call per range),
and greedy decoding, plain and with an EAGLE head reading layers from several ranges, token for
token; layer_ranges sizes the ranges within memory, the slowest as fast as can be."""

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

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


def test_layer_ranges_fit_the_memory_budgets_with_the_slowest_range_as_fast_as_can_be():
    """A range's time: its weights' bytes (the output layer's too, on the last) over its device's
    compute; each range within its device's memory (the embedding counts against the first)."""
    mb = 2**20
    assert layer_ranges(30, 10 * mb, [300 * mb, 300 * mb]) == [(0, 15), (15, 30)]
    assert layer_ranges(30, 10 * mb, [400 * mb, 200 * mb]) == [(0, 15), (15, 30)]  # room to spare: balanced
    assert layer_ranges(30, 10 * mb, [400 * mb, 100 * mb]) == [(0, 20), (20, 30)]  # the second holds 10
    assert layer_ranges(30, 10 * mb, [300 * mb, 300 * mb], embed_bytes=100 * mb) == [(0, 15), (15, 30)]  # a lookup
    # the output layer's work goes with the last range: SmolLM2-1.7B's shape (Q4_K_M: 39 MB a
    # layer, a 79 MB output layer) splits 13 / 11, as its ranges' measured step times balance
    assert layer_ranges(24, 40 * mb, [2e10, 2e10], embed_bytes=80 * mb, head_bytes=80 * mb) == [(0, 13), (13, 24)]
    assert layer_ranges(30, 10 * mb, [1e9, 1e9], compute=[1, 3]) == [(0, 7), (7, 30)]  # a faster device: more
    small = layer_ranges(4, mb, [1e9, 1e9, 1.5 * mb])  # a small device last: one layer, the rest split
    assert small[-1] == (3, 4) and sorted(b - a for a, b in small[:2]) == [1, 2]
    ranges = layer_ranges(7, mb, [5 * mb, 5 * mb, 5 * mb])
    assert [b - a for a, b in ranges] in ([3, 2, 2], [2, 3, 2], [2, 2, 3]) and ranges[-1][1] == 7
    with pytest.raises(SpecSotError, match=r"the devices' memory budgets hold 20 of the model's 30 layers \(300 MB\): "
                                           "add a device or raise their memory in devices.json"):  # fmt: skip
        layer_ranges(30, 10 * mb, [100 * mb, 100 * mb], names=["10.0.0.1#0", "10.0.0.2#0"])
    with pytest.raises(SpecSotError, match=r"10.0.0.1#0's memory budget \(300 MB\) holds none of the model's layers "
                                           r"\(10 MB each, beside the embedding\): raise it"):  # fmt: skip
        layer_ranges(30, 10 * mb, [300 * mb, 300 * mb], embed_bytes=295 * mb, names=["10.0.0.1#0", "10.0.0.2#0"])
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


def tiny_folder(path):
    """The 4-layer tiny model as a Hugging Face folder (made confident, as model() is)."""
    hf = tiny_hf("llama", num_hidden_layers=4, intermediate_size=128, vocab_size=112)
    hf.lm_head.weight.data.mul_(20)
    hf.save_pretrained(path)
    return path


def free_address() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


def serve_range(folder, address: str, *more: str) -> subprocess.Popen:
    """A range server of the tiny model's layers 2:4 (remote_range.py); `more`: its other arguments."""
    return subprocess.Popen([sys.executable, "-m", "specsot_mq.remote_range", "--model", str(folder), "--layers", "2:4",
                             "--bind", address, "--dtype", "fp32", *more])  # fmt: skip


def until(condition, what: str, seconds: float = 120) -> None:
    """Poll condition() until it holds; the test fails naming `what` after `seconds`."""
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, f"{what}: not within {seconds:.0f} s"
        time.sleep(0.05)


def gone(peer) -> bool:
    """Whether a range server's going away has reached this side (its socket's monitor)."""
    peer.events()
    return peer.gone


def back(peer) -> bool:
    """Whether this side has connected to a range server again since it went away."""
    peer.events()
    return peer.back


def test_a_range_loaded_alone_holds_that_range_of_the_whole_model(tmp_path):
    from specsot_mq.loader import load_model

    folder = tiny_folder(tmp_path / "m")
    whole = load_model(folder)
    for (first, last), part in zip(BOUNDS, split_layers(whole, BOUNDS)):
        alone = load_model(folder, layers=(first, last))
        assert (alone.first_layer, alone.last_layer) == (first, last)
        mine, want = dict(alone.state_dict()), dict(part.state_dict())
        assert mine.keys() == want.keys() and all(torch.equal(mine[k], want[k]) for k in mine)
    with pytest.raises(SpecSotError, match="not a range"):
        load_model(folder, layers=(3, 9))


def test_greedy_over_a_layer_range_in_another_process_equals_the_whole_model(tmp_path):
    """Layers 2:4 served by another process (remote_range.py), their hidden states and the cache
    operations going over ZeroMQ: the same logits and greedy tokens as the whole model, also for
    prompts sharing a prefix, a prefix store's restore, an accepted path moved in the cache, and
    an EAGLE head drafting over it with a copy of the output layer here."""
    from specsot_mq.loader import load_model
    from specsot_mq.messages import RangeCacheOp
    from specsot_mq.remote_range import RemoteRange

    folder = tiny_folder(tmp_path / "m")
    address = free_address()
    server = serve_range(folder, address)
    remote = None
    try:
        whole, local = load_model(folder), load_model(folder, layers=(0, 2))
        remote = RemoteRange(address, local.cfg, torch.float32, timeout_s=120)
        split = SplitModel([local, remote])
        assert (remote.first_layer, remote.last_layer) == (2, 4)
        prompts = [[1, 5, 6, 7, 8], [1, 5, 6, 9], [1, 5, 6, 40, 41]]
        gens = [Generator(m, CharTokenizer(), max_len=64, num_slots=3, tree=TreeParams(lookup=4)) for m in (whole, split)]
        for gen in gens:
            gen.keep_prefix([1, 5, 6])  # a later prompt starting so restores it (the prefix store)
        want, got = ([c.token_ids for c in g.generate_many(prompts, GREEDY, shared=3)] for g in gens)
        assert got == want
        assert [c.token_ids for c in gens[1].generate_many([[1, 5, 6, 70]], GREEDY)] == \
            [c.token_ids for c in gens[0].generate_many([[1, 5, 6, 70]], GREEDY)]  # fmt: skip
        # a prompt longer than a chunk: its prefill pipelined in chunks of 3 (split.py), the same
        # logits at every position and the same greedy tokens
        piped = SplitModel([local, remote], prefill_chunk=3)
        long = [[1, 5, 6, *range(20, 33)], [1, 5, 6, 7, 8, 9, 10]]
        want, got = ([c.token_ids for c in Generator(m, CharTokenizer(), max_len=64, num_slots=2).generate_many(long, GREEDY)]
                     for m in (whole, piped))  # fmt: skip
        assert got == want
        with torch.inference_mode():
            ids = torch.tensor([long[0]])
            full = [m(ids, m.new_cache(1, 32), Step.fresh(torch.arange(len(long[0]))[None])).logits for m in (whole, piped)]
            rows = [m(ids, m.new_cache(1, 32), Step.fresh(torch.arange(len(long[0]))[None], logit_rows=[4, 15])).logits
                    for m in (whole, piped)]  # fmt: skip
        torch.testing.assert_close(full[1], full[0], rtol=1e-5, atol=1e-5)  # (chunks may round differently)
        torch.testing.assert_close(rows[1], rows[0], rtol=1e-5, atol=1e-5)
        # an accepted draft path compacted in the cache (KVCache.move), then a step over it
        caches = [m.new_cache(1, 32) for m in (whole, split)]
        ids, step = torch.tensor([[1, 5, 6, 7, 8, 9]]), Step.fresh(torch.arange(6)[None])
        outs = []
        with torch.inference_mode():  # (as the server runs its range)
            for m, c in zip((whole, split), caches):
                m(ids, c, step)
                c.move(0, [3, 5], 3)
                outs.append(m(torch.tensor([[11]]), c, Step([0], [5], torch.tensor([[5]]))).logits)
        assert torch.equal(outs[0], outs[1])
        with pytest.raises(SpecSotError, match="give SplitModel its edges"):
            DraftHead(DraftConfig.for_base(whole.cfg, 50)).attach(split)
        # with a copy of the embedding and the output layer here (the edges), an EAGLE head whose
        # features come from both processes drafts over the remote range: the whole model's tokens
        edges = load_model(folder, layers=(0, 0))
        assert len(edges.layers) == 0 and torch.equal(edges.lm_head.weight, whole.lm_head.weight)
        edged = SplitModel([local, remote], edges=edges)
        assert edged.embed is local.embed and edged.lm_head is edges.lm_head
        torch.manual_seed(0)
        head = DraftHead(DraftConfig.for_base(whole.cfg, 50, (1, 3, 4)))
        head.d2t.copy_(torch.randperm(whole.cfg.vocab_size)[:50])
        head = head.attach(edged).eval().requires_grad_(False)
        eagle = Generator(edged, CharTokenizer(), max_len=64, num_slots=3, draft=head, tree=TreeParams(4, 2, 2))
        want = [c.token_ids for c in Generator(whole, CharTokenizer(), max_len=64, num_slots=3).generate_many(prompts, GREEDY)]
        assert [c.token_ids for c in eagle.generate_many(prompts, GREEDY)] == want
        # each cache here has its own there; one this process dropped is dropped there with the next
        # new one (also after other caches were made since it was: the EAGLE generator's above)
        named = caches[1].parts[1].name
        del caches[1], c, gens, split
        remote.new_cache(1, 8)
        with pytest.raises(SpecSotError, match=f"no cache {named} here"):
            remote.call(RangeCacheOp(named, "snapshot", 0, at=1))
        remote.new_cache(1, 8)
        with pytest.raises(SpecSotError, match=f"layer range at {address} failed: .*unknown cache operation 'rename'"):
            remote.call(RangeCacheOp(remote.new_cache(1, 8).name, "rename", 0))
    finally:
        if remote is not None:
            remote.stop()
        server.wait(timeout=60)


def test_rows_of_different_lengths_go_through_a_range_in_another_process_unpadded(tmp_path):
    """Where the server's model attends over a cache in place (the native kernels: quantized
    weights), the remote range says so for each cache it makes, so a step's causal rows of
    different lengths (prompt lookup's chains) go through it as one token per batch row, as over
    the whole model, not padded to the longest: the whole model's greedy tokens."""
    from specsot_mq.loader import load_model
    from specsot_mq.remote_range import RemoteRange

    if quant.native() is None:
        pytest.skip("the native kernels are not available on this machine")
    folder = tiny_folder(tmp_path / "m")
    address = free_address()
    server = serve_range(folder, address, "--quantize", "int4")
    remote = None
    try:
        whole, local = load_model(folder, quantize="int4"), load_model(folder, layers=(0, 2), quantize="int4")
        remote = RemoteRange(address, local.cfg, torch.float32, timeout_s=120)
        split = SplitModel([local, remote], prefill_chunk=0)
        with torch.inference_mode():  # (as the generation loop asks)
            assert split.attends_in_place(split.new_cache(3, 64)) and whole.attends_in_place(whole.new_cache(3, 64))
        shapes = []
        submit = remote.submit
        remote.submit = lambda x, cache, step: (shapes.append(tuple(x.shape[:2])), submit(x, cache, step))[1]
        prompts = [[1, 5, 6, 7, 8, 5, 6, 7], [1, 9, 10], [1, 40, 41, 40, 41]]
        params = SamplingParams(max_tokens=40, ignore_eos=True)
        want, got = ([c.token_ids for c in Generator(m, CharTokenizer(), max_len=128, num_slots=3,
                                                     tree=TreeParams(lookup=6)).generate_many(prompts, params)]
                     for m in (whole, split))  # fmt: skip
        assert got == want
        # some step had rows of different lengths, sent as more batch rows than sequences, one token each
        assert any(t == 1 and b > len(prompts) for b, t in shapes), shapes
    finally:
        if remote is not None:
            remote.stop()
        server.wait(timeout=60)


def test_a_layer_range_that_does_not_answer_is_named():
    from specsot_mq.remote_range import RemoteRange

    with pytest.raises(SpecSotError, match="tcp://127.0.0.1:9 did not answer in 1 s"):
        RemoteRange("tcp://127.0.0.1:9", model(False).cfg, torch.float32, timeout_s=1)


def test_the_routers_forward_over_a_split_model_reads_what_the_whole_model_gives():
    """The learned router's forward (a fixed beginning's keys and values reused, the forward stopped
    half way up) over a split model: the whole model's hidden state."""
    from specsot_mq.sot.learned_router import _kv, forward

    whole = model(False)
    split = SplitModel(split_layers(model(False), BOUNDS))
    head, ids = [1, 5, 6], [1, 5, 6, 7, 8, 9]
    got, want = (forward(m, ids, (2,), logits=False, held=_kv(forward(m, head, (2,), logits=False)[2]))[0][0]
                 for m in (whole, split))  # fmt: skip
    assert got.shape == (1, 3, whole.cfg.hidden_size) and torch.equal(got, want)


def test_a_layer_range_that_dies_fails_the_requests_it_held_and_serves_later_ones_once_restarted(tmp_path):
    """Its process killed with a forward pending there: that forward fails naming it; killed while
    idle with entries in use in its cache: the next request holding them fails at once, or, where
    the server restarted before it, the first one after the restart (they are lost); either way
    the next ones run on the restarted server, with the whole model's logits."""
    from specsot_mq.loader import load_model
    from specsot_mq.remote_range import RemoteRange

    folder = tiny_folder(tmp_path / "m")
    address = free_address()

    whole, local = load_model(folder), load_model(folder, layers=(0, 2))
    ids, step = torch.tensor([[1, 5, 6, 7]]), Step.fresh(torch.arange(4)[None])

    def logits(m):
        with torch.inference_mode():
            return m(ids, m.new_cache(1, 16) if m is whole else cache, step).logits

    server, remote = serve_range(folder, address), None
    try:
        remote = RemoteRange(address, local.cfg, torch.float32, timeout_s=120)
        split = SplitModel([local, remote])
        cache = split.new_cache(1, 16)
        torch.testing.assert_close(logits(split), logits(whole))
        os.kill(server.pid, signal.SIGSTOP)  # a forward pending there when it dies
        with torch.inference_mode():
            x = local(ids, cache.parts[0], replace(step, logit_rows=[], hidden_layers=(2,))).hidden[-1]
        remote.submit(x, cache.parts[1], step)
        server.kill()
        server.wait()
        with pytest.raises(SpecSotError, match=f"layer range at {address} went away before it answered"):
            remote.result()
        cache.forget()  # as the slot manager does when a batch fails: no entry is in use
        server = serve_range(folder, address)
        torch.testing.assert_close(logits(split), logits(whole))  # its cache made again there
        server.kill()  # and now while idle, entries in use in its cache: the next forward fails at
        server.wait()  # once, not waiting for a restart that may never come
        until(lambda: gone(remote.peers[0]), "the server's going away")
        with pytest.raises(SpecSotError, match=f"layer range at {address} went away"):
            logits(split)
        cache.forget()
        server = serve_range(folder, address)  # a request holding nothing there waits for the restart
        torch.testing.assert_close(logits(split), logits(whole))
        server.kill()  # idle again, and restarted before the next request: that one's entries are lost
        server.wait()
        until(lambda: gone(remote.peers[0]), "the server's going away")
        server = serve_range(folder, address)
        until(lambda: back(remote.peers[0]), "the restarted server's connection")
        with pytest.raises(SpecSotError, match=f"layer range at {address} restarted"):
            logits(split)
        torch.testing.assert_close(logits(split), logits(whole))
    finally:
        if remote is not None and server.poll() is None:
            remote.stop()
        server.kill()
        server.wait(timeout=60)


def test_a_layer_range_with_a_replica_loses_nothing_when_either_dies(tmp_path):
    """Layers 2:4 served twice: every request goes to both, the first answers. Its process killed
    with a forward pending there, the replica answers that forward, and decoding goes on with the
    whole model's logits and greedy tokens. Restarted, it rejoins between two steps of a sequence
    still decoding, the entries in use copied to it from the replica; then the replica dies and
    that sequence's next step, on the first alone, still has the whole model's logits."""
    from specsot_mq.loader import load_model
    from specsot_mq.remote_range import RemoteRange

    folder = tiny_folder(tmp_path / "m")
    addresses = [free_address(), free_address()]
    servers = [serve_range(folder, a) for a in addresses]
    remote = None
    try:
        whole, local = load_model(folder), load_model(folder, layers=(0, 2))
        remote = RemoteRange(addresses, local.cfg, torch.float32, timeout_s=120)
        split = SplitModel([local, remote])
        ids, step = torch.tensor([[1, 5, 6, 7]]), Step.fresh(torch.arange(4)[None])
        steps = [(torch.tensor([[t]]), Step([0], [4 + i], torch.tensor([[4 + i]]))) for i, t in enumerate([9, 11, 13])]
        with torch.inference_mode():
            cache, want_cache = split.new_cache(1, 16), whole.new_cache(1, 16)
            want = [whole(ids, want_cache, step).logits] + [whole(t, want_cache, at).logits for t, at in steps]
            x = local(ids, cache.parts[0], replace(step, logit_rows=[], hidden_layers=(2,))).hidden[-1]
            os.kill(servers[0].pid, signal.SIGSTOP)  # a forward pending at the first when it dies
            remote.submit(x, cache.parts[1], step)
            servers[0].kill()
            servers[0].wait()
            got = [remote.result().logits, split(steps[0][0], cache, steps[0][1]).logits]  # the replica answers, then decodes on
            assert [p.state for p in remote.peers] == ["down", "sync"]
            prompts = [[1, 5, 6, 7, 8], [1, 5, 6, 9]]
            gens = [Generator(m, CharTokenizer(), max_len=64, num_slots=2) for m in (whole, split)]
            want_tokens, got_tokens = ([c.token_ids for c in g.generate_many(prompts, GREEDY)] for g in gens)
            assert got_tokens == want_tokens
            servers[0] = serve_range(folder, addresses[0])
            until(lambda: remote.peers[0].events() or remote.peers[0].back, "the first server connected again")
            got.append(split(steps[1][0], cache, steps[1][1]).logits)  # rejoins first, the cache's entries copied
            assert [p.state for p in remote.peers] == ["sync", "sync"]
            servers[1].kill()  # the replica
            servers[1].wait()
            until(lambda: gone(remote.peers[1]), "the replica's going away")
            got.append(split(steps[2][0], cache, steps[2][1]).logits)  # on the first alone
        torch.testing.assert_close(got, want)
        assert [p.state for p in remote.peers] == ["sync", "down"]
    finally:
        if remote is not None and servers[0].poll() is None:
            remote.stop()
        for server in servers:
            server.kill()
            server.wait(timeout=60)


def test_split_ranges_size_the_ranges_by_memory_and_compute_and_check_every_replica(tmp_path):
    from specsot_mq.devices import parse_devices
    from specsot_mq.sot.scheduler import DeviceProfile
    from specsot_mq.stages.launch import split_ranges

    folder = tiny_folder(tmp_path / "m")  # 4 layers of 148 KB, an output layer of 28 KB
    big, small = DeviceProfile("big", 1, 3e-3, 1, 1), DeviceProfile("small", 1, 2e-4, 1, 1)  # the small one holds 1
    devices = parse_devices("127.0.0.1#cpu0,127.0.0.1#cpu1,127.0.0.1#cpu2,127.0.0.1#cpu3")
    profiles = {d.name: p for d, p in zip(devices, [big, small, big, small])}
    assert split_ranges(devices[:2], profiles, folder) == [(0, 3), (3, 4)]  # by memory
    fast = DeviceProfile("fast", 3, 3e-3, 1, 1)
    assert split_ranges(devices[:2], {devices[0].name: big, devices[1].name: big}, folder) == [(0, 2), (2, 4)]
    assert split_ranges(devices[:2], {devices[0].name: big, devices[1].name: fast}, folder) == [(0, 1), (1, 4)]
    assert split_ranges(devices, profiles, folder, replicas=2) == [(0, 3), (3, 4), (0, 3), (3, 4)]
    with pytest.raises(SpecSotError, match="127.0.0.1#cpu2's layers 0:3 \\(a replica\\) need"):
        split_ranges(devices, profiles | {"127.0.0.1#cpu2": DeviceProfile("tiny", 1, 1e-5, 1, 1)}, folder, 2)
    with pytest.raises(SpecSotError, match="--replicas 3: give a number of devices that it divides"):
        split_ranges(devices, profiles, folder, replicas=3)
    with pytest.raises(SpecSotError, match="needs at least 2 devices"):
        split_ranges(devices[:1], profiles, folder)


def test_a_range_server_on_a_core_board_computes_on_its_share_and_holds_no_core_between_requests(tmp_path):
    """The CPU range servers of a host share its cores as its device stages do (core_share.py): a
    forward runs on every core while the other ranges wait for work, on its share while they
    compute too, and a server with no request waiting holds none; the logits are the same."""
    import threading

    from specsot_mq.core_share import CoreShare
    from specsot_mq.loader import load_model
    from specsot_mq.remote_range import RangeServer, RemoteRange

    folder = tiny_folder(tmp_path / "m")
    path = tmp_path / "board"
    mine, other = CoreShare(path, 0, 2, 4), CoreShare(path, 1, 2, 4)
    server, address, threads = RangeServer(load_model(folder, layers=(2, 4)), mine), free_address(), torch.get_num_threads()
    serving = threading.Thread(target=server.serve, args=(address,), daemon=True)
    serving.start()
    remote = None
    try:
        whole, local = load_model(folder), load_model(folder, layers=(0, 2))
        remote = RemoteRange(address, local.cfg, torch.float32, timeout_s=120)
        split, ids = SplitModel([local, remote]), torch.tensor([[1, 5, 6, 7, 8]])

        def logits(m):
            with torch.inference_mode():
                return m(ids, m.new_cache(1, 16), Step.fresh(torch.arange(5)[None])).logits

        want = logits(whole)
        torch.testing.assert_close(logits(split), want)
        assert server.threads == 4  # the other range idle: every core of the board
        until(lambda: (mine.board[0], mine.board[1]) == (0, 0), "the server holding no core once it has no request")
        other.board[2] = 1  # the other range has work (it holds no core yet)
        torch.testing.assert_close(logits(split), want)
        assert server.threads == 2
        until(lambda: (mine.board[0], mine.board[1]) == (0, 0), "the server holding no core once it has no request")
    finally:
        if remote is not None:
            remote.stop()
        serving.join(60)
        torch.set_num_threads(threads)


def test_a_launch_puts_its_cpu_range_servers_on_one_core_board_and_removes_it_when_it_stops(tmp_path):
    from specsot_mq.core_share import CoreShare
    from specsot_mq.devices import parse_devices
    from specsot_mq.sot.scheduler import default_profiles_path, load_profiles
    from specsot_mq.stages.launch import Launcher, plan_run

    devices, profiles = parse_devices("127.0.0.1#cpu0,127.0.0.1#cpu1"), load_profiles(default_profiles_path())
    spec = plan_run(devices, profiles, "p2p", tmp_path, ranges=[(0, 2), (2, 4)])
    launcher = Launcher(spec, tmp_path)
    boards = [(cmd := launcher._command(name))[cmd.index("--board") + 1] for name in spec.ranges]
    path = boards[0].rsplit(":", 2)[0]
    assert boards == [f"{path}:0:2", f"{path}:1:2"] and "--threads" not in launcher._command("range@127.0.0.1#cpu0")
    CoreShare(Path(path), 0, 2, 2)  # as the first server makes it
    launcher.stop()
    assert not Path(path).exists()
    fixed = Launcher(plan_run(devices, profiles, "p2p", tmp_path, stage_threads=1, ranges=[(0, 2), (2, 4)]), tmp_path)
    cmd = fixed._command("range@127.0.0.1#cpu1")
    assert "--board" not in cmd and cmd[cmd.index("--threads") + 1] == "1"
