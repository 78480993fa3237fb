"""The Skeleton-of-Thought engine: every phase is lossless against plain greedy decoding of that
phase's own prompt, points decoded together equal each alone, and routing picks the direct way."""

import re

import pytest
import torch

from conftest import ours_from_hf, tiny_hf
from specsot_mq.errors import PromptTooLong
from specsot_mq.generate import Delta, Generator
from specsot_mq.sampling import SamplingParams
from specsot_mq.messages import Answer, AnswerText, Ask, PointText, Skeleton, SkeletonText
from specsot_mq.sot.engine import SoTEngine
from specsot_mq.sot.flow import Flow, SoTConfig, finished_lines, point_params, point_prompts, skeleton_params
from specsot_mq.sot.parser import Plan, Point, parse_skeleton
from specsot_mq.sot.router import Route
from specsot_mq.sot.scheduler import DeviceProfile
from specsot_mq.prompts import direct_ids, load_format
from specsot_mq.tokenizer import chat_prompt_ids, load_tokenizer

pytestmark = pytest.mark.slow  # the real tokenizer comes with the default model
PLAN = Plan("plan", [Point(1, "Warm up"), Point(2, "Pick shoes", 80), Point(3, "Start slowly"),
                     Point(4, "Track progress", 20), Point(5, "Rest well")])  # fmt: skip
PARAMS = SamplingParams(max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny(default_model_dir):
    """A tiny random model over the real tokenizer: fast, and exact in fp32."""
    tok = load_tokenizer(default_model_dir)
    model = ours_from_hf(tiny_hf("llama", vocab_size=len(tok), max_position_embeddings=1024))
    return Generator(model, tok, max_len=512, num_slots=5)


def point_ids(events) -> dict[int, list[int]]:
    """Each point's tokens, from its streamed text."""
    out = {}
    for e in events:
        if isinstance(e, PointText):
            out.setdefault(e.index, []).extend(e.token_ids.tolist())
    return out


def expand(gen, max_parallel):
    engine = SoTEngine(gen, SoTConfig(max_parallel=max_parallel, point_tokens=12))
    events = list(engine.expand("How do I start running?", PLAN, PARAMS))
    return engine, point_ids(events), events[-1]


def test_points_decoded_together_equal_each_prompt_decoded_alone(tiny):
    engine, got, final = expand(tiny, max_parallel=5)
    prefix, suffixes = point_prompts(engine.gen.tokenizer, engine.format, "How do I start running?", PLAN)
    for index, suffix in suffixes.items():
        alone = tiny.generate(prefix + suffix, point_params(engine.config, PARAMS, PLAN)).token_ids
        assert got[index] == alone, index
    assert [i for i, _, _ in final.points] == [1, 2, 3, 4, 5]  # in plan order
    # Each point ran into its 12-token cap without finishing a sentence: none is worth reading by the
    # merge's rules, so the answer shows every point as it wrote it rather than nothing.
    assert final.stats["dropped_points"] == [] and final.answer.startswith("1. Warm up:")
    assert all(f"{p.index}. {p.title}:" in final.answer for p in PLAN.points)


def test_points_share_every_token_before_their_own_words(tiny):
    """The point prompt names its point only in its answer's prefill: the shared prefix holds the
    whole request (instructions, question, plan), a point's own suffix is the chat template's turn
    change and `N. Title:`, and prefix + suffix is the point's prompt."""
    tok, fmt, question = tiny.tokenizer, load_format("sot"), "How do I start running?"
    prefix, suffixes = point_prompts(tok, fmt, question, PLAN)
    outline = "\n".join(f"{p.index}. {p.title}" for p in PLAN.points)
    assert question in tok.decode(prefix) and outline in tok.decode(prefix)
    for p in PLAN.points:
        assert prefix + suffixes[p.index] == fmt.point_ids(tok, question, outline, p.index, p.title)
        own = tok.decode(suffixes[p.index])
        assert own.endswith(f"{p.index}. {p.title}:") and p.title not in own[: -len(f"{p.index}. {p.title}:")]
        turn_and_name = f"<|im_end|>\n<|im_start|>assistant\n{p.index}. {p.title}:"
        assert len(suffixes[p.index]) <= len(tok.encode(turn_and_name, add_special_tokens=False))
    assert fmt.merge([(1, "Warm up", " Walk first.\n"), (2, "Pick shoes", " Light ones.")]) == (
        "1. Warm up: Walk first.\n2. Pick shoes: Light ones.")


def test_the_answer_leaves_out_a_points_last_line_where_it_repeats_an_earlier_one():
    """A point's loop stop (stop_repeated_line) ends it at the end of a line that repeats an
    earlier one, after that line has streamed: the merged answer leaves the repeat out. The
    README's question did this on SmolLM2 (point 2, "Stay hydrated")."""
    fmt = load_format("sot")
    looped = (" \n- Drink plenty of water to stay healthy.\n- Staying hydrated is a great way to stay healthy.\n"
              "- staying hydrated is a great way to stay healthy!\n")
    assert fmt.merge([(2, "Stay hydrated", looped), (3, "Sleep", " Sleep 8 hours.")]) == (
        "1. Stay hydrated:\n- Drink plenty of water to stay healthy.\n- Staying hydrated is a great way to stay healthy."
        "\n2. Sleep: Sleep 8 hours.")
    # Lines that only look alike stay, and so does one line on its own.
    kept = " Walk.\nWalk more.\n"
    assert fmt.merge([(1, "Exercise", kept), (2, "Pace", " Run.")]) == "1. Exercise: Walk.\nWalk more.\n2. Pace: Run."


def test_the_skeleton_prompt_shows_its_examples_as_earlier_turns(tiny):
    tok, fmt = tiny.tokenizer, load_format("sot")
    text = tok.decode(fmt.skeleton_ids(tok, "How do I start running?"))
    assert len(fmt.examples) == 3 and text.count("<|im_start|>assistant") == 4
    for question, skeleton in fmt.examples:
        assert question in text and skeleton in text
    # the example that names its count is asked for what its plan shows, as a counted question is
    assert "exactly 5 points" in text and text.count("of 3 to 8 points") == 3
    assert text.endswith("Question: How do I start running?<|im_end|>\n<|im_start|>assistant\n1.")


@pytest.mark.parametrize("eagle", [False, True])
def test_a_kept_prefix_gives_the_same_tokens_and_computes_only_the_rest(tiny, tiny_eagle, eagle, monkeypatch):
    """Generator.keep_prefix: a prompt that begins with the kept tokens starts from a copy of
    their KV (and the draft head's) and computes only its own part, with the same output; two
    such prompts admitted together compute their own parts in one forward."""
    base = tiny_eagle if eagle else tiny
    fresh = Generator(base.model, base.tokenizer, max_len=512, num_slots=2, draft=base.draft, tree=base.tree)
    fmt, params = load_format("sot"), SamplingParams(max_tokens=12, ignore_eos=True)
    prompt, other = (fmt.skeleton_ids(base.tokenizer, q) for q in ("How do I start running?", "Why is the sky blue?"))
    want = [fresh.generate(p, params).token_ids for p in (prompt, other, [5, 6, 7])]
    head = fmt.skeleton_heads(base.tokenizer)[0]
    assert 100 < len(head) < len(prompt) and prompt[: len(head)] == head == other[: len(head)]
    fresh.keep_prefix(head)
    widths, forward = [], type(base.model).forward
    monkeypatch.setattr(type(base.model), "forward", lambda self, ids, *a, **k: widths.append(tuple(ids.shape)) or forward(self, ids, *a, **k))
    assert [fresh.generate(p, params).token_ids for p in (prompt, other, [5, 6, 7])] == want
    assert widths[0] == (1, len(prompt) - len(head))  # the first forward: only what follows the kept part
    calls = len(widths)
    fresh.keep_prefix(head)  # kept already: no second computation
    assert len(fresh.prefixes) == 1 and len(widths) == calls
    together = fresh.generate_many([prompt, other], params)
    assert [c.token_ids for c in together] == want[:2]
    assert widths[calls] == (2, max(len(prompt), len(other)) - len(head))  # both own parts, one forward


def test_the_engine_keeps_every_prompt_beginning_that_no_question_changes(tiny):
    """The skeleton prompt's instructions (one for a question that names its number of points,
    whose request differs, one for the rest, and one for each of the format's variants, which a
    counted skeleton short of points is asked with), a point prompt's and a direct answer's system
    prompt and instructions up to the question: each begins every such prompt, and is computed
    and kept in the prefix store the first time such a prompt runs (keep_heads: all at once),
    with the same answer as without it."""
    from specsot_mq.prompts import direct_ids

    gen = Generator(tiny.model, tiny.tokenizer, max_len=512, num_slots=2)
    fmt = load_format("sot")
    engine = SoTEngine(gen, SoTConfig(max_parallel=2, sot="always"))
    (skeleton, counted, bare, other), (point, direct) = fmt.skeleton_heads(tiny.tokenizer), fmt.answer_heads(tiny.tokenizer)
    heads = (skeleton, counted, bare, other, point, direct)
    assert len(gen.prefixes) == 0  # none up front: a one-off question needs two or three
    params = SamplingParams(max_tokens=8)
    first = engine.generate("How do I start running?", params)
    kept = {tuple(h) for h in heads if h in gen.prefixes}
    assert tuple(skeleton) in kept and tuple(counted) not in kept  # this question's skeleton, not a counted one's
    assert kept & {tuple(point), tuple(direct)}  # and its points' or its direct answer's
    engine.keep_heads()
    assert all(head in gen.prefixes for head in heads) and len(set(map(tuple, heads))) == 6
    assert engine.generate("How do I start running?", params).answer == first.answer  # from the kept heads: the same
    q, counted_q = "How do I start running?", "Give me four tips for running."
    for question, count, examples, head in ((q, None, None, skeleton), (counted_q, 6, None, counted),
                                            (counted_q, 4, fmt.variants[0], bare), (counted_q, 4, fmt.variants[1], other)):  # fmt: skip
        prompt = fmt.skeleton_ids(tiny.tokenizer, question, count=count, examples=examples)
        assert prompt[: len(head)] == head and len(head) > (100 if examples != () else 10)  # (the bare one: no examples)
    assert fmt.point_ids(tiny.tokenizer, q, "1. Shoes\n2. Pace", 2, "Pace")[: len(point)] == point
    assert direct_ids(tiny.tokenizer, q)[: len(direct)] == direct
    assert len(point) > 10 and len(direct) > 5  # instructions and a system prompt, not an empty match


@pytest.mark.parametrize("eagle", [False, True])
def test_a_conversations_earlier_turns_are_computed_once_across_its_turns(tiny, tiny_eagle, eagle, monkeypatch):
    """A job's `keep` puts its prompt's first tokens in the prefix store after its prefill; the
    next turn's prompt, which begins with them, computes only the rest and decodes the same
    tokens; another conversation's prompt shares nothing of it. Past the store's budget the
    least recently used entry goes, a pinned one stays."""
    from specsot_mq.generate import Job
    from specsot_mq.prompts import direct_ids

    base = tiny_eagle if eagle else tiny
    gen = Generator(base.model, base.tokenizer, max_len=512, num_slots=2, draft=base.draft, tree=base.tree)
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    turn1 = direct_ids(base.tokenizer, "Tell me about Rome.")
    history = [{"role": "user", "content": "Tell me about Rome."}, {"role": "assistant", "content": "It is old."}]
    turn2 = direct_ids(base.tokenizer, "Name two colors.", history)
    other = direct_ids(base.tokenizer, "Name two colors.", [{"role": "system", "content": "Be brief."}])
    assert turn2[: len(turn1)] == turn1
    want = [gen.generate(p, params).token_ids for p in (turn2, other)]

    def run(ids, keep=0):
        jobs = [Job(0, ids, params, keep=keep)]
        return [t for _, d in gen.run(lambda room: [jobs.pop()] if jobs else [], gen.new_decoder(params)) for t in d.token_ids]

    run(turn1, keep=len(turn1))
    assert turn1 in gen.prefixes
    widths, forward = [], type(base.model).forward
    monkeypatch.setattr(type(base.model), "forward", lambda self, ids, *a, **k: widths.append(tuple(ids.shape)) or forward(self, ids, *a, **k))
    assert run(turn2) == want[0]
    assert widths[0] == (1, len(turn2) - len(turn1))  # only the new turn
    widths.clear()
    assert run(other) == want[1] and widths[0] == (1, len(other))  # nothing shared: computed whole
    # Points: prompts sharing a prefix that begins with a stored turn compute that prefix from it.
    points = [turn2 + [7, 8, 9, n] for n in (10, 11)]
    want_points = [c.token_ids for c in Generator(base.model, base.tokenizer, max_len=512, num_slots=2, draft=base.draft,
                                                  tree=base.tree).generate_many(points, params, shared=len(turn2) + 3)]  # fmt: skip
    jobs = [Job(n, p, params, len(turn2) + 3, "points") for n, p in enumerate(points)]
    widths.clear()
    got = {0: [], 1: []}
    for key, d in gen.run(lambda room: [jobs.pop(0) for _ in range(min(room, len(jobs)))], gen.new_decoder(params)):
        got[key] += d.token_ids
    assert [got[0], got[1]] == want_points
    assert widths[0] == (1, len(turn2) + 3 - len(turn1))  # the rest of the prefix, from the stored turn on
    # Past the budget the least recently used goes; the pinned head stays.
    gen.keep_prefix(turn1[:20])
    run(other, keep=len(other))
    assert gen.prefixes.longest(turn2).ids == turn1  # turn1's entry is now the most recently used
    store = gen.prefixes
    store.budget = store.size - 1
    store.fit()
    assert turn1 in store and other not in store and turn1[:20] in store


def test_two_at_a_time_equals_all_at_once(tiny):
    assert expand(tiny, max_parallel=2)[1] == expand(tiny, max_parallel=5)[1]


@pytest.fixture(scope="module")
def tiny_eagle(tiny):
    """The tiny model with an untrained EAGLE head over 512 draft tokens."""
    from specsot_mq.draft import DraftConfig, DraftHead
    from specsot_mq.speculative import TreeParams

    torch.manual_seed(0)
    head = DraftHead(DraftConfig.for_base(tiny.model.cfg, 512)).attach(tiny.model).eval().requires_grad_(False)
    return Generator(tiny.model, tiny.tokenizer, max_len=512, num_slots=5, draft=head, tree=TreeParams(6, 3, 2))


def test_questions_the_router_sends_direct_get_the_plain_answer(tiny):
    asked = []
    router = lambda q: asked.append(q) or Route(False, "the router says direct")  # noqa: E731
    engine = SoTEngine(tiny, SoTConfig(max_parallel=5), router=router)
    final = engine.generate("What is 17 * 23?", PARAMS)
    assert isinstance(final, Answer) and final.mode == "direct" and not final.points
    assert final.answer == tiny.generate("What is 17 * 23?", PARAMS).text and final.reason == "the router says direct"
    assert asked == ["What is 17 * 23?"]
    assert engine.generate("What is 17 * 23?", PARAMS, history=[]).mode == "direct"
    assert SoTEngine(tiny, SoTConfig(sot="never", max_parallel=5), router=router).generate("Why?", PARAMS).mode == "direct"
    assert len(asked) == 2  # --sot never asks no router


def test_prompts_longer_than_the_cache_fail_at_once_or_go_the_direct_way(tiny):
    """In a cache too small for them: a skeleton's prompt (--sot always) is one PromptTooLong
    before anything is decoded or streamed (the engine computed the prompts' shared beginnings
    first, and one longer than the cache crashed it), and a plan whose points' prompts would not
    fit is answered the direct way, whose prompt fits."""
    tok, question = tiny.tokenizer, "How do I start running?"
    skeleton = len(load_format("sot").skeleton_ids(tok, question))
    small = SoTEngine(Generator(tiny.model, tok, max_len=skeleton - 1, num_slots=5), SoTConfig(sot="always", max_parallel=5))
    with pytest.raises(PromptTooLong, match=f"the prompt is {skeleton} tokens and the KV cache holds {skeleton - 1} per"):
        next(small.stream(question, PARAMS))
    prefix, suffixes = point_prompts(tok, small.format, question, PLAN)
    longest = len(prefix) + max(map(len, suffixes.values()))
    fits = SoTEngine(Generator(tiny.model, tok, max_len=longest, num_slots=5), SoTConfig(max_parallel=5))
    assert list(fits.expand(question, PLAN, PARAMS))[-1].mode == "sot"
    short = SoTEngine(Generator(tiny.model, tok, max_len=longest - 1, num_slots=5), SoTConfig(max_parallel=5))
    final = list(short.expand(question, PLAN, PARAMS))[-1]
    assert final.mode == "direct" and final.reason == f"the points' prompts ({longest} tokens) would not fit the cache ({longest - 1})"
    assert final.answer == short.gen.generate(question, PARAMS).text


def scripted(tok, chain: dict[int, int]):
    """A tiny model whose greedy next token depends only on the current token: chain[x] after x
    (layers zeroed, so each position's embedding goes straight to the output layer)."""
    model = ours_from_hf(tiny_hf("llama", vocab_size=len(tok), max_position_embeddings=1024))
    with torch.no_grad():
        for p in [*model.layers.parameters(), model.embed.weight, model.lm_head.weight]:
            p.zero_()
        for i, (x, y) in enumerate(chain.items()):
            model.embed.weight[x, i] = 1.0
            model.lm_head.weight[y, i] = 10.0
    return model


def test_plan_format_direct_reply_is_answered_directly(default_model_dir):
    """The [PLAN]/[DIRECT] format: a model that replies "[DIRECT]" stops its skeleton right there
    (the stream shows "[DIRECT]"), and the question gets the plain answer of its own prompt."""
    tok = load_tokenizer(default_model_dir)
    question = "How do I start running?"
    skeleton = load_format("plan").skeleton_ids(tok, question)
    direct = chat_prompt_ids(tok, question)
    tag = tok.encode("DIRECT]", add_special_tokens=False)
    hi = tok.encode(" Hi", add_special_tokens=False)[0]
    chain = dict(zip([skeleton[-1], *tag[:-1]], tag)) | {tag[-1]: hi, direct[-1]: hi, hi: tok.eos_token_id}
    gen = Generator(scripted(tok, chain), tok, max_len=256, num_slots=2)
    engine = SoTEngine(gen, SoTConfig(sot="always", prompt_format="plan", max_parallel=2))
    events = list(engine.stream(question, SamplingParams(max_tokens=12)))
    assert "".join(e.text for e in events if isinstance(e, SkeletonText)) == "[DIRECT]"
    final = events[-1]
    assert final.mode == "direct" and "the model chose [DIRECT]" in final.reason
    assert final.answer == "".join(e.text for e in events if isinstance(e, AnswerText)) == " Hi"
    assert final.stats["skeleton"]["tokens"] == len(tag)  # it stopped at the tag, not at max tokens


# MT-bench first turns 3-5 (writing), as they stand in ../shared/data/mt_bench_questions.jsonl:
# each plans 4 points on the default model in fp32.
MT_BENCH_PLANNED = [
    "Imagine you are writing a blog post comparing two popular smartphone models. Develop an outline for the blog "
    "post, including key points and subheadings to effectively compare and contrast the features, performance, and "
    "user experience of the two models. Please answer in fewer than 200 words.",
    "Write a descriptive paragraph about a bustling marketplace, incorporating sensory details such as smells, sounds, "
    "and visual elements to create an immersive experience for the reader.",
    "Could you write a captivating short story beginning with the sentence: The old abandoned house at the end of the "
    "street held a secret that no one had ever discovered.",
]


def test_a_counted_plans_spares_stop_once_its_count_is_shown(default_model_dir):
    """The default model plans "three tips" with two spares; once the answer shows three points,
    the points after them stop ("abort") and the answer is what merging every point in full would
    give; every point's tokens are a prefix of plain greedy decoding of its prompt (the shown
    ones all of it)."""
    from specsot_mq.loader import load_generator
    from specsot_mq.messages import PointEnd
    from specsot_mq.sot.flow import points_asked

    gen = load_generator(dtype="fp32", num_slots=8, max_len=1024)
    plain = Generator(gen.model, gen.tokenizer, max_len=1024)
    engine = SoTEngine(gen, SoTConfig(sot="always", point_tokens=48))
    params, question = SamplingParams(max_tokens=128), "Give me three tips for staying healthy."
    events = list(engine.stream(question, params))
    final, ends = events[-1], {e.index: e.finish for e in events if isinstance(e, PointEnd)}
    assert final.mode == "sot" and len(final.points) == points_asked(question) == 5
    assert re.findall(r"^\d+\. ", final.answer, re.M) == ["1. ", "2. ", "3. "]  # three points shown
    stopped = [i for i, finish in ends.items() if finish == "abort"]
    shown = set(ends) - set(final.stats["dropped_points"])
    assert stopped and set(stopped) <= set(final.stats["dropped_points"]) and min(stopped) > max(shown)
    plan = Plan("plan", [Point(i, title) for i, title, _ in final.points])
    prefix, suffixes = point_prompts(gen.tokenizer, engine.format, question, plan)
    done = point_ids(events)
    for index, suffix in suffixes.items():
        want = plain.generate(prefix + suffix, point_params(engine.config, params, plan)).token_ids
        got = done.get(index, [])
        assert got == (want[: len(got)] if index in stopped else want), index


def test_a_counted_questions_points_are_asked_what_sets_each_apart(tiny):
    """A question that names its number of points gets the format's point_counted request (what
    the point is and why it matters); any other question the plain one. Both begin with the
    point prompts' kept head."""
    fmt, tok = load_format("sot"), tiny.tokenizer
    head = fmt.answer_heads(tok)[0]
    counted = fmt.point_ids(tok, "Give me three tips for a hike.", "1. Water\n2. Map", 2, "Map")
    open_ = fmt.point_ids(tok, "How do I plan a hike?", "1. Water\n2. Map", 2, "Map")
    assert fmt.point_counted and "why it matters" in tok.decode(counted) and "why it matters" not in tok.decode(open_)
    assert counted[: len(head)] == open_[: len(head)] == head


def test_a_short_counted_skeletons_new_points_come_from_its_variants_greedy_lists(default_model_dir):
    """The default model lists three distinct ways of the five a question asks for ("Use a
    fireplace" again and again), so its variants are asked: the skeleton is plain greedy
    decoding of its prompt, then points each of which a variant's prompt, decoded plainly,
    lists too (the parser's title: less a closing full stop); with them the plan has the count."""
    from dataclasses import replace

    from specsot_mq.loader import load_generator
    from specsot_mq.sot.flow import points_asked

    gen = load_generator(dtype="fp32", num_slots=8, max_len=1024)
    plain = Generator(gen.model, gen.tokenizer, max_len=1024)
    engine = SoTEngine(gen, SoTConfig(sot="always", point_tokens=48))
    fmt, tok, params = engine.format, gen.tokenizer, SamplingParams(max_tokens=128)
    question = "List five ways to stay warm in a cold house without raising the heating bill."
    final = engine.generate(question, params)
    assert final.mode == "sot" and final.stats["skeleton"]["variants"] == len(fmt.variants) == 2
    asked = skeleton_params(engine.config, params, points_asked(question))
    first = plain.generate(fmt.skeleton_ids(tok, question, (), points_asked(question)), asked)
    assert final.skeleton.startswith(fmt.skeleton_prefix + first.text) and first.finish_reason == "stop"
    added = re.findall(r"\n\d+\. (.+)", final.skeleton[len(fmt.skeleton_prefix + first.text):])
    each = replace(asked, max_tokens=(asked.max_tokens - len(first.token_ids)) // 2)
    lists = [fmt.skeleton_prefix + plain.generate(fmt.skeleton_ids(tok, question, (), 5, v), each).text for v in fmt.variants]
    assert added and all(any(re.search(rf"^\d+\. {re.escape(t)}\.?$", s, re.M) for s in lists) for t in added)
    assert len(final.points) >= 5 > len(parse_skeleton(fmt.skeleton_prefix + first.text, 7, question).points)


def test_real_model_phases_equal_plain_greedy(default_model_dir):
    """The default model with the shipped head, fp32, on three MT-bench first turns that plan at
    least 3 points each: the skeleton equals plain greedy decoding of the skeleton prompt, and
    every point equals plain greedy decoding of its full prompt."""
    from specsot_mq.loader import load_generator

    gen = load_generator(dtype="fp32", num_slots=8, max_len=1024)
    plain = Generator(gen.model, gen.tokenizer, max_len=1024)
    engine = SoTEngine(gen, SoTConfig(sot="always", point_tokens=48))
    params = SamplingParams(max_tokens=128)
    for question in MT_BENCH_PLANNED:
        events = list(engine.stream(question, params))
        final = events[-1]
        sk_prompt = engine.format.skeleton_ids(gen.tokenizer, question)
        skeleton = plain.generate(sk_prompt, skeleton_params(engine.config, params))
        assert [t for e in events if isinstance(e, SkeletonText) for t in e.token_ids.tolist()] == skeleton.token_ids
        assert "".join(e.text for e in events if isinstance(e, SkeletonText)) == final.skeleton
        assert final.mode == "sot" and len(final.points) >= 3, (question[:60], final.skeleton)
        plan = parse_skeleton(finished_lines(final.skeleton, skeleton.finish_reason), 8, question)
        prefix, suffixes = point_prompts(engine.gen.tokenizer, engine.format, question, plan)
        done = point_ids(events)
        for index, suffix in suffixes.items():
            want = plain.generate(prefix + suffix, point_params(engine.config, params, plan)).token_ids
            assert done[index] == want, (question[:60], index)


def test_a_counted_skeleton_short_of_points_asks_its_variants_once(tiny):
    """Skeletoning.next_round: a counted list that ended ("stop") with fewer distinct points than
    its question names is asked again, once, with each of the format's variants (its prompt
    with other worked examples), all in one round. Their text reaches the stream only once the
    round has ended, as the points new to the skeleton numbered on from its last item: not a
    repeat, not a cut-off last line, none past the count and SPARE. A list with its count of
    points, a cut-off one and an uncounted one are not asked again."""
    tok, flow = tiny.tokenizer, Flow(SoTConfig(sot="always"), tiny.tokenizer)
    fmt, question = flow.format, "Give me three tips for a hike."
    assert len(fmt.variants) == 2
    state = flow.route(Ask("r", question, SamplingParams(max_tokens=64), "always"))
    assert state.add(("r", 0), Delta(" Water\n2. Map\n3. Water", [1, 2, 3], "stop")).text == " Water\n2. Map\n3. Water"
    text, jobs = state.next_round(tok)
    assert text is None and [job.key for job in jobs] == [("r", 1), ("r", 2)]
    for job, examples in zip(jobs, fmt.variants):
        assert job.ids == fmt.skeleton_ids(tok, question, (), 3, examples) and job.params.max_tokens == (64 - 3) // 2
    assert fmt.skeleton_ids(tok, question, (), 3, fmt.variants[0]) != fmt.skeleton_ids(tok, question, (), 3)
    # The first variant repeats a point and is cut off by its cap; the second lists one past the cap.
    assert state.add(("r", 1), Delta(" Map\n2. Hat\n3. Torc", [4, 5, 6], "length")) is None
    assert state.next_round(tok) == (None, [])  # the other variant still decoding
    assert state.add(("r", 2), Delta(" Boots\n2. Snacks\n3. Sunscreen", [7, 8], "stop")) is None
    text, jobs = state.next_round(tok)
    assert text.text == "\n4. Hat\n5. Boots\n6. Snacks" and jobs == []  # Water, Map and these: 3 + SPARE
    assert tok.decode(text.token_ids) == text.text
    assert state.next_round(tok) == (None, [])  # once only
    skeleton = state.done()
    assert skeleton.text == "1. Water\n2. Map\n3. Water\n4. Hat\n5. Boots\n6. Snacks" and skeleton.finish == "stop"
    assert skeleton.stats["skeleton"]["variants"] == 2 and skeleton.stats["skeleton"]["tokens"] == 8
    assert [t for _, t, _ in flow.parse(skeleton).points] == ["Water", "Map", "Hat", "Boots", "Snacks"]

    def again(question: str, written: str, finish: str) -> list:
        state = flow.route(Ask("r", question, SamplingParams(max_tokens=64), "always"))
        state.add(("r", 0), Delta(written, [1, 2], finish))
        return state.next_round(tok)[1]

    assert again("Give me three tips for a hike.", " Water\n2. Map", "stop")  # short: asked again
    assert not again("Give me three tips for a hike.", " Water\n2. Map\n3. Hat", "stop")  # its count
    assert not again("Give me three tips for a hike.", " Water\n2. Map", "length")  # cut off by its cap
    assert not again("How do I plan a hike?", " Water\n2. Map", "stop")  # no count named

    # A counted question whose skeleton is no usable plan: the direct way, its prompt asking for the count.
    planned = flow.parse(Skeleton("r", "Give me three tips for a hike.", SamplingParams(), "sot", "", "1. Water\n2. Water", {}))
    assert planned.mode == "direct" and planned.count == 3
    _, prompts = flow.assign(planned, [DeviceProfile("local", 1.0, 1.0, 1.0, 8)])
    asked = flow.format.counted_direct.format(question="Give me three tips for a hike.", count=3)
    assert "exactly 3" in asked and prompts.prompt(0) == direct_ids(tok, asked) and prompts.keep == 0
