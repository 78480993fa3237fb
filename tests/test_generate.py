"""The generation loop on a tiny model: stopping, streaming, sampling, and text deltas."""

import asyncio
import subprocess
import sys

import pytest
import torch

from conftest import ours_from_hf, tiny_hf
from specsot_mq.errors import SpecSotError
from specsot_mq.generate import Generator
from specsot_mq.model import Step
from specsot_mq.sequence import Delta, Output
from specsot_mq.sampling import Sampler, SamplingParams, greedy_tokens
from specsot_mq.stopping import LineWatch, StopStrings


class CharTokenizer:
    """Token i is chr(65 + i); token 0 is the EOS; enough of the tokenizer API for the loop."""

    eos_token_id = 0
    end_ids = frozenset({0})
    chat_template = None

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(65 + i) for i in ids if not (skip_special_tokens and i == 0))

    def encode(self, text):
        return [ord(c) - 65 for c in text]


@pytest.fixture(scope="module")
def gen():
    return Generator(ours_from_hf(tiny_hf("llama")), CharTokenizer(), max_len=128)


def greedy_reference(gen, prompt, n):
    """Greedy decoding by re-running the whole sequence each step (no cache reuse)."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            cache = gen.model.new_cache(1, 128)
            logits = gen.model(torch.tensor([ids]), cache, Step.fresh(torch.arange(len(ids))[None])).logits
            ids.append(int(logits[0, -1].argmax()))
    return ids[len(prompt) :]


def test_greedy_equals_full_recompute_and_stops_at_max_tokens(gen):
    prompt = [5, 6, 7, 8]
    done = gen.generate(prompt, SamplingParams(max_tokens=12, ignore_eos=True))
    assert done.token_ids == greedy_reference(gen, prompt, 12)
    assert done.finish_reason == "length" and done.prompt_tokens == 4


def test_eos_stops_and_has_no_text(gen):
    prompt = [5, 6, 7, 8]
    free = gen.generate(prompt, SamplingParams(max_tokens=12, ignore_eos=True)).token_ids
    gen.eos_ids = frozenset({free[3]})
    try:
        done = gen.generate(prompt, SamplingParams(max_tokens=12))
    finally:
        gen.eos_ids = frozenset({0})
    cut = free.index(free[3])
    assert done.token_ids == free[: cut + 1] and done.finish_reason == "stop"
    assert done.text == CharTokenizer().decode(free[:cut])


def test_stop_string_ends_the_text_before_it(gen):
    prompt = [5, 6, 7, 8]
    free = gen.generate(prompt, SamplingParams(max_tokens=12, ignore_eos=True)).text
    stop = free[5:7]
    done = gen.generate(prompt, SamplingParams(max_tokens=12, stop=(stop,), ignore_eos=True))
    assert done.text == free[: free.index(stop)] and done.finish_reason == "stop"
    last = list(gen.stream(prompt, SamplingParams(max_tokens=12, stop=(stop,), ignore_eos=True)))[-1]
    assert last.stop == stop  # the delta names the stop string it ended on (not in its text)


def first_loop(tokens: list[int], n: int) -> int | None:
    """How many tokens the output keeps under repeat_stop=n: up to the end of the first run of n
    tokens that already ran earlier (None: no run repeats)."""
    runs = [tuple(tokens[i - n : i]) for i in range(n, len(tokens) + 1)]
    return next((n + k for k, run in enumerate(runs) if run in runs[:k]), None)


@pytest.mark.parametrize("n", [2, 3, 5])
def test_repeat_stop_ends_the_output_at_the_end_of_its_first_repeated_run(gen, n):
    prompt = [5, 6, 7, 8]
    free = gen.generate(prompt, SamplingParams(max_tokens=60, ignore_eos=True)).token_ids
    keep = first_loop(free, n)
    assert keep is not None and keep < 60  # a tiny random model falls into a loop soon
    done = gen.generate(prompt, SamplingParams(max_tokens=60, ignore_eos=True, repeat_stop=n))
    assert done.token_ids == free[:keep] and done.finish_reason == "repeat"
    assert done.text == CharTokenizer().decode(free[:keep])
    assert gen.generate(prompt, SamplingParams(max_tokens=keep - 1, ignore_eos=True, repeat_stop=n)).finish_reason == "length"


def test_callback_and_async_stream_see_the_same_deltas(gen):
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    seen = []
    done = gen.generate([1, 2, 3], params, on_delta=seen.append)

    async def collect():
        return [d async for d in gen.astream([1, 2, 3], params)]

    streamed = asyncio.run(collect())
    assert [d.token_ids for d in streamed] == [d.token_ids for d in seen]
    assert "".join(d.text for d in streamed) == done.text
    assert [d.finish_reason for d in streamed] == [None] * 9 + ["length"]


def test_async_streams_step_on_one_model_thread(gen, monkeypatch):
    """Every step of every astream runs on the Generator's one model thread, not the caller's,
    and the caller's OpenMP pool is released first: one pool for the model (openmp.py)."""
    import threading

    import specsot_mq.generate as generate

    released = []
    monkeypatch.setattr(generate, "release_pool", lambda: released.append(threading.get_ident()))
    threads = []
    forward = gen.model.forward
    gen.model.forward = lambda *a, **k: threads.append(threading.get_ident()) or forward(*a, **k)
    params = SamplingParams(max_tokens=6, ignore_eos=True)

    async def collect():
        return [[d async for d in gen.astream([1, 2, 3], params)] for _ in range(2)]

    try:
        first, second = asyncio.run(collect())
    finally:
        del gen.model.forward
    assert first[-1].finish_reason == second[-1].finish_reason == "length"
    assert len(threads) >= 12 and len(set(threads)) == 1 and threading.get_ident() not in threads
    assert released == [threading.get_ident()] * 2  # by the caller, once per stream


def test_release_pool_frees_the_calling_thread_s_openmp_threads():
    """openmp.release_pool ends the calling thread's OpenMP pool (the process has fewer threads
    after it), so another thread can run the model with the only pool."""
    code = """
import time, torch
from specsot_mq.openmp import release_pool
def threads():
    return int(next(l for l in open("/proc/self/status") if l.startswith("Threads:")).split()[1])
torch.set_num_threads(4)
x = torch.ones(4_000_000)
for _ in range(3):
    x = x * 1.0001  # parallel work: this thread gets a pool of 4
before = threads()
ok = release_pool()
deadline = time.monotonic() + 60
while before - threads() < 3 and time.monotonic() < deadline:  # the pool's threads end in their own time
    time.sleep(0.01)
print(ok, before - threads())
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    released, fewer = out.stdout.split()
    assert released == "True" and int(fewer) == 3  # the pool's 3 threads besides the caller


def test_seeded_sampling_is_reproducible_and_differs_from_greedy(gen):
    params = SamplingParams(max_tokens=16, temperature=1.5, seed=7, ignore_eos=True)
    a = gen.generate([1, 2, 3], params).token_ids
    b = gen.generate([1, 2, 3], params).token_ids
    greedy = gen.generate([1, 2, 3], SamplingParams(max_tokens=16, ignore_eos=True)).token_ids
    assert a == b and a != greedy


def test_prompt_longer_than_the_cache_is_a_clear_error():
    g = Generator(ours_from_hf(tiny_hf("llama")), CharTokenizer(), max_len=8)
    with pytest.raises(SpecSotError, match=r"the prompt is 9 tokens and the KV cache holds 8 .*--max-len"):
        g.generate(list(range(1, 10)))


def test_a_serving_worker_fails_only_the_request_whose_prompt_is_too_long():
    """Three requests in one running batch: the one whose prompt cannot fit fails with the message
    (its other job stops too); the others finish as if it had never come."""
    from specsot_mq.generate import Job
    from specsot_mq.stages.worker import DeviceWorker

    g = Generator(ours_from_hf(tiny_hf("llama")), CharTokenizer(), max_len=32, num_slots=4)
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    alone = {tuple(p): g.generate(p, params).token_ids for p in ([1, 2, 3], [4, 5, 6, 7])}

    async def scenario():
        loop = asyncio.get_running_loop()
        tokens, finish, errors, done = {}, {}, {}, asyncio.Event()

        def emit(key, delta):
            tokens.setdefault(key, []).extend(delta.token_ids)
            if delta.finish_reason:
                finish[key] = delta.finish_reason
            if {("a", 0), ("c", 0)} <= finish.keys() and errors:
                done.set()

        def on_error(key, error, code):
            errors[key] = (error, code)

        worker = DeviceWorker(lambda: g, emit, loop, on_error)
        assert await worker.ready is g
        worker.submit([Job(("a", 0), [1, 2, 3], params)], "greedy")
        worker.submit([Job(("b", 0), list(range(1, 40)), params), Job(("b", 1), [1, 2], params)], "greedy")
        worker.submit([Job(("c", 0), [4, 5, 6, 7], params)], "greedy")
        await asyncio.wait_for(done.wait(), 60)
        worker.close()
        return tokens, finish, errors

    tokens, finish, errors = asyncio.run(scenario())
    error, code = errors[("b", 0)]
    assert list(errors) == [("b", 0)] and "the prompt is 39 tokens" in error and "--max-len" in error and code == "too_long"
    assert tokens[("a", 0)] == alone[(1, 2, 3)] and tokens[("c", 0)] == alone[(4, 5, 6, 7)]
    assert finish[("a", 0)] == finish[("c", 0)] == "length"
    assert ("b", 1) not in tokens  # the failed request's other job, admitted with it, never ran


def test_a_serving_worker_loads_and_decodes_on_its_own_thread_taking_its_core_share(tmp_path):
    """Every torch call of a stage runs on the worker's one thread (one OpenMP pool per process),
    and before each step the worker takes its share of the host's cores from the board."""
    import threading

    from specsot_mq.core_share import CoreShare
    from specsot_mq.generate import Job
    from specsot_mq.stages.worker import DeviceWorker

    g = Generator(ours_from_hf(tiny_hf("llama")), CharTokenizer(), max_len=32, num_slots=2)
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    threads, shares = set(), []
    forward = g.model.forward
    g.model.forward = lambda *a, **k: threads.add(threading.get_ident()) or forward(*a, **k)
    share, other = CoreShare(tmp_path / "board", 0, 2, 4), CoreShare(tmp_path / "board", 1, 2, 4)
    take = share.take
    share.take = lambda: shares.append(take()) or shares[-1]

    def load():
        threads.add(threading.get_ident())
        return g

    async def scenario():
        loop = asyncio.get_running_loop()
        done = asyncio.Event()

        def emit(key, delta):
            if delta.finish_reason:
                done.set()

        worker = DeviceWorker(load, emit, loop, lambda key, error: None, share)
        await worker.ready
        other.board[2 * other.index] = 1  # the host's other stage has work: a half share from now on
        worker.submit([Job(("a", 0), [1, 2, 3], params)], "greedy")
        await asyncio.wait_for(done.wait(), 60)
        await asyncio.sleep(0.1)  # the batch drains
        worker.close()
        return worker.thread.ident

    ident = asyncio.run(scenario())
    assert threads == {ident} and ident != threading.get_ident()
    assert shares[0] == 4 and shares[-1] == 2 and len(shares) >= 4  # loading alone, then a step each
    assert share.board[0] == share.board[1] == 0  # out of work: it holds no cores


def test_a_worker_sends_a_job_s_first_tokens_and_its_end_at_once_and_the_rest_together_at_intervals():
    """A device stage's deltas leave its worker joined per job: each message wakes the processes
    it passes through on the cores the next step needs, so a job's first tokens (time to first
    text) and its end go at once, and the rest of the batch's tokens together every interval."""
    from specsot_mq.sequence import Delta
    from specsot_mq.stages.worker import Coalescer

    now = [0.0]
    c = Coalescer(0.05, clock=lambda: now[0])
    assert c.add("a", Delta("A", [1])) == [("a", Delta("A", [1]))]
    now[0] = 0.01
    assert c.add("b", Delta("B", [2])) == [("b", Delta("B", [2]))]
    assert c.add("a", Delta("a", [3])) == [] and c.add("b", Delta("b", [4])) == []
    now[0] = 0.02
    assert c.add("a", Delta("x", [5])) == []
    now[0] = 0.05  # an interval since they last went together: every job's held tokens go
    assert c.add("b", Delta("y", [6])) == [("a", Delta("ax", [3, 5], steps=2)), ("b", Delta("by", [4, 6], steps=2))]
    now[0] = 0.06
    assert c.add("a", Delta("!", [7], "stop", "\n")) == [("a", Delta("!", [7], "stop", "\n"))]
    assert c.add("b", Delta("z", [8])) == []
    assert c.add("b", Delta("", [9], "length")) == [("b", Delta("z", [8, 9], "length", steps=2))]
    assert not c.held and not c.started


# ---- the sampler ------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_greedy_tokens_are_argmax_ties_included(dtype):
    """greedy_tokens (torch.max) picks what argmax picks, the first of tied maxima too: logits of
    a few distinct values tie all the time."""
    gen = torch.Generator().manual_seed(0)
    for shape in [(1, 49152), (13, 49152), (3, 2, 4096), (5, 7)]:
        tied = torch.randint(-3, 4, shape, generator=gen).to(dtype)
        spread = torch.randn(shape, generator=gen).to(dtype)
        for logits in (tied, spread):
            assert torch.equal(greedy_tokens(logits), logits.argmax(-1))
    assert greedy_tokens(torch.tensor([[1.0, 3.0, 3.0, 2.0]], dtype=dtype)).tolist() == [1]


def test_top_k_and_top_p_keep_the_right_tokens():
    logits = torch.log(torch.tensor([[0.5, 0.25, 0.15, 0.1]]))
    k2 = Sampler(SamplingParams(temperature=1.0, top_k=2)).probs(logits)
    assert torch.allclose(k2, torch.tensor([[2 / 3, 1 / 3, 0, 0]]))
    p = Sampler(SamplingParams(temperature=1.0, top_p=0.7)).probs(logits)  # 0.5 + 0.25 reaches 0.7
    assert torch.allclose(p, torch.tensor([[2 / 3, 1 / 3, 0, 0]]))
    tiny_p = Sampler(SamplingParams(temperature=1.0, top_p=0.01)).probs(logits)
    assert torch.allclose(tiny_p, torch.tensor([[1.0, 0, 0, 0]]))
    m = Sampler(SamplingParams(temperature=1.0, min_p=0.4)).probs(logits)  # below 0.4 x 0.5 = 0.2: dropped
    assert torch.allclose(m, torch.tensor([[2 / 3, 1 / 3, 0, 0]]))
    hot = Sampler(SamplingParams(temperature=2.0, min_p=0.5)).probs(logits)  # after temperature: flatter, more kept
    assert hot[0, :3].gt(0).all() and hot[0, 3] == 0


def test_sampling_frequencies_follow_the_distribution():
    target = torch.tensor([0.6, 0.3, 0.1])
    sampler = Sampler(SamplingParams(temperature=1.0, seed=3))
    draws = sampler(torch.log(target).expand(20000, 3))
    freq = torch.bincount(draws, minlength=3).float() / 20000
    assert (freq - target).abs().max() < 0.02


def test_top_p_over_the_top_candidates_equals_sorting_the_whole_vocabulary(monkeypatch):
    """Rows whose nucleus lies within the top candidates and rows that reach past them (flat ones,
    sorted in full) in one batch: each is cut exactly where sorting its whole row cuts it."""
    import specsot_mq.sampling as sampling

    monkeypatch.setattr(sampling, "TOP_P_CANDIDATES", 8)
    torch.manual_seed(0)
    probs = torch.softmax(torch.randn(6, 64) * torch.tensor([[8.0], [0.1], [4.0], [0.5], [20.0], [1.0]]), -1)
    for top_p in (0.3, 0.9, 0.99):
        got = sampling.top_p_filter(probs, top_p)
        ranked, order = torch.sort(probs, -1, descending=True)
        ref = torch.zeros_like(probs).scatter_(-1, order, ranked.masked_fill(ranked.cumsum(-1) - ranked >= top_p, 0))
        ref = ref / ref.sum(-1, keepdim=True)
        assert torch.allclose(got, ref)
        kept = (got > 0).sum(-1)
        assert kept.max() > 8 and kept.min() < 8  # both kinds of rows were there


def test_inverse_cdf_draws_follow_the_distribution_and_never_a_zero():
    from specsot_mq.sampling import sample

    target = torch.tensor([0.0, 0.5, 0.0, 0.3, 0.2, 0.0])
    gen = torch.Generator().manual_seed(1)
    draws = sample((target * 7).expand(30000, 6), gen)  # unnormalised rows are fine
    counts = torch.bincount(draws, minlength=6)
    assert counts[target == 0].sum() == 0
    freq = counts.float() / 30000
    assert (freq - target).abs().max() < 0.015
    edge = torch.tensor([[0.0, 1.0, 0.0]]).expand(1000, 3)  # a draw at the very top still lands on a token
    assert sample(edge, gen).eq(1).all()


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": -1}, "temperature"),
        ({"top_k": -2}, "top_k"),
        ({"top_p": 0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"min_p": -0.1}, "min_p"),
        ({"min_p": 1.5}, "min_p"),
        ({"repeat_stop": -1}, "repeat_stop"),
    ],
)
def test_bad_sampling_params_are_named(kwargs, message):
    with pytest.raises(SpecSotError, match=message):
        SamplingParams(**kwargs)


# ---- stop strings over streamed pieces --------------------------------------------------


@pytest.mark.parametrize(
    "pieces, stops, released, stopped",
    [
        (["Hello", " wor", "ld"], (), ["Hello", " wor", "ld"], None),
        (["Hel", "lo ST", "OP more"], ("STOP",), ["Hel", "lo ", ""], "STOP"),
        (["abc", "S", "TOxyz"], ("STOP",), ["abc", "", "STOxyz"], None),  # a near miss is released
        (["x</s", "> tail"], ("zz", "</s>"), ["x", ""], "</s>"),
        (["aXb"], ("b", "X"), ["a"], "X"),  # the earliest stop wins
    ],
)
def test_stop_state_holds_back_only_what_could_start_a_stop(pieces, stops, released, stopped):
    state = StopStrings(stops)
    out, hit = [], None
    for i, piece in enumerate(pieces):
        text, hit = state.feed(piece, final=i == len(pieces) - 1)
        out.append(text)
        if hit:
            break
    assert out == released and hit == stopped


@pytest.mark.parametrize(
    "pieces, stops, released, stopped",
    [
        (["\n\n", "Text.", "\n\nMore"], ("\n\n",), "\n\nText.", "\n\n"),  # opening blank line kept
        ([" \n", "\n", "a\n\n"], ("\n\n",), " \n\na", "\n\n"),  # the same, in pieces
        (["\n2. b"], ("\n2.",), "", "\n2."),  # a stop that reaches into the text still counts
        (["  \n\n"], ("\n\n",), "  \n\n", None),  # only whitespace: nothing stops it yet
    ],
)
def test_stop_after_text_skips_stops_in_the_leading_whitespace(pieces, stops, released, stopped):
    state = StopStrings(stops, after_text=True)
    out, hit = "", None
    for i, piece in enumerate(pieces):
        text, hit = state.feed(piece, final=i == len(pieces) - 1)
        out += text
        if hit:
            break
    assert out == released and hit == stopped
    whole = "".join(pieces)  # without after_text, every case stops at its first match
    assert StopStrings(stops).feed(whole, final=True) == (whole[: whole.find(stops[0])], stops[0])


class WordTokenizer:
    """Token i is WORDS[i] (0 is the EOS): enough of the tokenizer API for one output's bookkeeping."""

    WORDS = ["", "1.", " Sleep", " well", "\n", "2.", " Less", " coffee", "3.", " sleep", " WELL", "!", "4.", " Walk"]
    eos_token_id = 0
    end_ids = frozenset({0})

    def decode(self, ids, skip_special_tokens=True):
        return "".join(self.WORDS[i] for i in ids)


@pytest.mark.parametrize("on", [True, False])
def test_stop_repeated_line_ends_the_output_with_the_line_that_repeats_an_earlier_one(on):
    tok = WordTokenizer()
    text = "1. Sleep well\n2. Less coffee\n3. sleep WELL!\n4. Walk"
    ids = [1, 2, 3, 4, 5, 6, 7, 4, 8, 9, 10, 11, 4, 12, 13]
    assert tok.decode(ids) == text
    out = Output(tok, SamplingParams(max_tokens=50, stop_repeated_line=on), frozenset([0]))
    delta = out.take(ids)  # a speculative step proposing every token at once stops where one-by-one would
    if on:
        assert delta.finish_reason == "repeat" and delta.text == "1. Sleep well\n2. Less coffee\n3. sleep WELL!\n"
    else:
        assert delta.finish_reason is None and delta.text == text


def test_max_line_chars_ends_the_output_once_one_line_runs_past_it():
    """A line longer than max_line_chars ends the output (finish "length", the way a cap does),
    counted from the line's own start: earlier lines, however many, never add up."""
    tok = CharTokenizer()
    short = "1. Sleep well\n2. Less coffee\n3. Walk daily"
    params = SamplingParams(max_tokens=200, max_line_chars=16)
    assert Output(tok, params, frozenset([0])).take(tok.encode(short)) == Delta(short, tok.encode(short), None, None)
    long = "1. Sleep\n2. Sleep is when the body repairs itself"
    delta = Output(tok, params, frozenset([0])).take(tok.encode(long))
    assert delta.finish_reason == "length" and delta.text == long[: len("1. Sleep\n") + 17]
    with pytest.raises(SpecSotError, match="max_line_chars"):
        SamplingParams(max_line_chars=-1)


def test_line_watch_reads_lines_over_pieces_and_ignores_numbers_case_and_marks():
    watch = LineWatch()
    said = [watch.add(p) for p in [" **Warm", " up**\n", "2) Pick shoes\n\n", "- Start slowly.\n", "4. pick SHOES"]]
    assert said == [False, False, False, False, False]  # the last line is not finished yet
    assert watch.add("\n") is True
    assert LineWatch().add("1. a\n\n\n2. b\n") is False  # blank lines are not repeats of each other


def test_line_watch_with_items_splits_a_list_that_runs_on_in_one_line():
    pieces = ["1. Sleep well", " 2. Less", " coffee 3", ". sleep well", " 4", ". Walk"]
    assert [LineWatch().add(p) for p in pieces] == [False] * 6  # one line, never finished
    watch = LineWatch(items=True)
    assert [watch.add(p) for p in pieces] == [False, False, False, False, False, True]  # "3." ends at " 4. "
    # a decimal is not an item: split there, "1.5 kg" would be a line repeated
    assert LineWatch(items=True).add("x 1.5 kg 1.5 kg\n") is False


@pytest.mark.parametrize("items", [True, False])
def test_stop_repeated_item_ends_an_output_that_lists_its_point_again_in_one_line(items):
    tok = CharTokenizer()
    text = " Sleep well: 1. Sleep well: 2. Walk"
    params = SamplingParams(max_tokens=100, stop_repeated_line=True, stop_repeated_item=items)
    delta = Output(tok, params, frozenset([0])).take(tok.encode(text))
    if items:
        assert delta.finish_reason == "repeat" and delta.text == " Sleep well: 1. Sleep well: 2. "
    else:
        assert delta.finish_reason is None and delta.text == text


def test_several_sequences_decoded_together_equal_each_alone():
    g = Generator(ours_from_hf(tiny_hf("qwen2")), CharTokenizer(), max_len=64, num_slots=3)
    prompts = [[5, 6, 7, 8, 9], [12, 3], [40, 41, 42]]
    maxes = SamplingParams(max_tokens=9, ignore_eos=True)
    together = g.generate_many(prompts, maxes)
    for prompt, done in zip(prompts, together):
        assert done.token_ids == greedy_reference(g, prompt, 9)
        assert done.finish_reason == "length"


def test_sequences_finish_independently():
    g = Generator(ours_from_hf(tiny_hf("llama")), CharTokenizer(), max_len=64, num_slots=2)
    prompts = [[5, 6, 7], [9, 10]]
    free = g.generate_many(prompts, SamplingParams(max_tokens=8, ignore_eos=True))
    g.eos_ids = frozenset({free[0].token_ids[2]})  # sequence 0 meets its EOS at its third token
    both = g.generate_many(prompts, SamplingParams(max_tokens=8))
    first_eos = free[0].token_ids.index(free[0].token_ids[2])
    assert both[0].token_ids == free[0].token_ids[: first_eos + 1] and both[0].finish_reason == "stop"
    cut = [i for i, t in enumerate(free[1].token_ids) if t in g.eos_ids]
    expected = free[1].token_ids[: cut[0] + 1] if cut else free[1].token_ids
    assert both[1].token_ids == expected


def test_more_prompts_than_slots_wait_for_a_free_slot():
    """With max_parallel 2, the third and fourth prompts join as others finish; every output
    equals that prompt decoded alone."""
    g = Generator(ours_from_hf(tiny_hf("llama")), CharTokenizer(), max_len=64, num_slots=2)
    # Five equal-length prompts: both slots free up in the same round while others still wait.
    prompts = [[5, 6, 7], [9, 10], [11, 12, 13, 14], [20], [30, 31]]
    done = g.generate_many(prompts, SamplingParams(max_tokens=6, ignore_eos=True), max_parallel=2)
    for prompt, d in zip(prompts, done):
        assert d.token_ids == greedy_reference(g, prompt, 6)


def test_shared_prefix_is_computed_once_and_gives_the_same_tokens():
    g = Generator(ours_from_hf(tiny_hf("qwen3")), CharTokenizer(), max_len=64, num_slots=2)
    prefix = [3, 1, 4, 1, 5, 9, 2, 6]
    prompts = [prefix + [7], prefix + [8, 9, 10], prefix + [11, 12]]  # three prompts, two slots
    together = g.generate_many(prompts, SamplingParams(max_tokens=6, ignore_eos=True), shared=len(prefix))
    for prompt, d in zip(prompts, together):
        assert d.token_ids == greedy_reference(g, prompt, 6)
