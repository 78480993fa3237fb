"""Skeleton-of-Thought logic without a model: the skeleton parser (tables, and random strings it must
never raise on), the points worth reading (duplicates, restatements, counts, the merged answer), the
router's modes and its fallback rules, the LPT branch scheduler and the devices.json checks. The
learned router on the real model: tests/test_router.py."""

import json
import random

import pytest

from specsot_mq.devices import device_profiles, parse_devices
from specsot_mq.errors import SpecSotError
from specsot_mq.generate import Delta
from specsot_mq.prompts import FOLDER, load_format
from specsot_mq.sampling import SamplingParams
from specsot_mq.messages import Ask, Skeleton
from specsot_mq.sot.flow import (SKELETON_LINE_CHARS, Flow, SoTConfig, finished_lines, point_params, points_asked,
                                 skeleton_params, skeleton_text)  # fmt: skip
from specsot_mq.sot.ordered import OrderedAnswer, dropped_points
from specsot_mq.sot.overlap import content_words, restates, same_point, says_nothing
from specsot_mq.sot.parser import SPARE, Plan, Point, asked_count, parse_plan_direct, parse_skeleton
from specsot_mq.sot.router import Route, route, rule_route, short_answer
from specsot_mq.sot.scheduler import (
    DeviceProfile,
    default_profiles_path,
    load_profiles,
    schedule,
)
from specsot_mq.stopping import LineWatch

FIFTY = "\n".join(f"{n}. Point number {n}" for n in range(1, 51))
LONG_TITLE = ("1. Introduction: explain what quantum superposition is and why it matters for computing "
              "and cryptography today\n2. Entanglement")

PARSE_CASES = [
    # (name, skeleton text, kind, [(title, predicted_tokens)] of the plan)
    ("plain list", "1. Intro\n2. Body\n3. Conclusion", "plan", [("Intro", None), ("Body", None), ("Conclusion", None)]),
    ("prefill with a space after it", "1. Sleep well\n2. Eat well", "plan", [("Sleep well", None), ("Eat well", None)]),
    ("parentheses as markers", "1) Sleep\n2) Exercise", "plan", [("Sleep", None), ("Exercise", None)]),
    ("items run together on one line", "1. Sleep 2. Eat 3. Move", "plan",
     [("Sleep", None), ("Eat", None), ("Move", None)]),
    ("an inline number that is not next stays in the title", "1. Pick 3. options\n2. Compare them", "plan",
     [("Pick 3. options", None), ("Compare them", None)]),
    ("decimals are not markers", "1. Python 3.12 features\n2. Migration", "plan",
     [("Python 3.12 features", None), ("Migration", None)]),
    ("a doubled marker goes", "1. 1. Sleep\n2. 2) Diet\n3. **3.** Move", "plan", [("Sleep", None), ("Diet", None), ("Move", None)]),
    ("markdown and trailing colons go", "1. **Sleep:**\n2. __Diet__.\n3. `Exercise`:", "plan",
     [("Sleep", None), ("Diet", None), ("Exercise", None)]),
    ("bold markers and bullets", "1. Sleep\n**2.** Diet\n- 3. Exercise\n> 4. Rest", "plan",
     [("Sleep", None), ("Diet", None), ("Exercise", None), ("Rest", None)]),
    ("numbering gaps are renumbered", "1. Sleep\n3. Diet\n7. Exercise", "plan",
     [("Sleep", None), ("Diet", None), ("Exercise", None)]),
    ("a repeated number keeps the first", "1. Sleep\n2. Diet\n2. Food\n3. Exercise", "plan",
     [("Sleep", None), ("Diet", None), ("Exercise", None)]),
    ("a repeated title keeps the first", "1. Sleep\n2. Diet\n3. sleep\n4. Exercise", "plan",
     [("Sleep", None), ("Diet", None), ("Exercise", None)]),
    ("a restarted list is dropped", "1. Sleep 2. Diet 3. Exercise\n1. Sleep 2. Diet", "plan",
     [("Sleep", None), ("Diet", None), ("Exercise", None)]),
    ("predicted lengths are read off", "1. Sleep (~40 tokens)\n2. Diet [25]\n3. Exercise (60 tokens).\n4. Rest", "plan",
     [("Sleep", 40), ("Diet", 25), ("Exercise", 60), ("Rest", None)]),
    ("a year in parentheses is not a length", "1. The war (1945)\n2. The peace", "plan",
     [("The war (1945)", None), ("The peace", None)]),
    ("a long title is cut to its first clause", LONG_TITLE, "plan", [("Introduction", None), ("Entanglement", None)]),
    ("a long title without a break is cut to 12 words", "1. " + " ".join(["word"] * 20) + "\n2. End", "plan",
     [(" ".join(["word"] * 12), None), ("End", None)]),
    ("sub-bullets and text before and after are ignored",
     "Here is the plan:\n1. Sleep\n   - eight hours\n2. Diet\n\nThat is all.", "plan",
     [("Sleep", None), ("Diet", None)]),
    ("unicode titles", "1. 睡眠\n2. Ernährung\n3. Упражнения", "plan",
     [("睡眠", None), ("Ernährung", None), ("Упражнения", None)]),
    ("fifty points are capped at ten", FIFTY, "plan", [(f"Point number {n}", None) for n in range(1, 11)]),
    ("a title saying what an earlier one says is dropped",
     "1. Upgrade your living room\n2. Paint the walls\n3. Living room upgrades\n4. Wall paint", "plan",
     [("Upgrade your living room", None), ("Paint the walls", None)]),
    ("a title inside an earlier one is dropped", "1. Wear sunscreen daily\n2. Water\n3. Sunscreen daily", "plan",
     [("Wear sunscreen daily", None), ("Water", None)]),
    ("points may each name the topic", "1. Aria\n2. Aria's voice\n3. Aria's smile", "plan",
     [("Aria", None), ("Aria's voice", None), ("Aria's smile", None)]),
    ("numbered titles are different points", "1. Day 1\n2. Day 2\n3. Day three\n4. Day 3", "plan",
     [("Day 1", None), ("Day 2", None), ("Day three", None)]),
    ("a head and its explanation is the head", "1. Comfort: Soft and supportive\n2. Grip: Lugs", "plan",
     [("Comfort", None), ("Grip: Lugs", None)]),
    ("a numbered head keeps its explanation", "1. Day 2: Visit the old town\n2. Day three: Rest all day", "plan",
     [("Day 2: Visit the old town", None), ("Day three: Rest all day", None)]),
    ("a head repeating an earlier title is dropped", "1. Comfort\n2. Weight\n3. Comfort: Comfortable and light", "plan",
     [("Comfort", None), ("Weight", None)]),
    ("one point is not worth splitting", "1. Just answer it", "direct", []),
    ("items without titles do not count", "1. Sleep\n2. **\n3. ---", "direct", []),
    ("no list at all", "The sky is blue because of Rayleigh scattering.", "direct", []),
    ("empty", "", "error", []),
    ("whitespace only", " \n\t ", "error", []),
    ("the bare prefill", "1.", "error", []),
    ("garbage without letters", "1. 2. ### 3) ... 42 !!", "error", []),
]


@pytest.mark.parametrize("name, text, kind, points", PARSE_CASES, ids=[c[0] for c in PARSE_CASES])
def test_parse_skeleton(name, text, kind, points):
    plan = parse_skeleton(text)
    assert plan.kind == kind, plan.reason
    assert [(p.title, p.predicted_tokens) for p in plan.points] == points
    assert [p.index for p in plan.points] == list(range(1, len(points) + 1))
    if kind != "plan":
        assert plan.reason


PLAN_DIRECT_CASES = [
    # (name, reply, kind, titles)
    ("[DIRECT] goes direct", "[DIRECT]", "direct", []),
    ("[DIRECT] with text after it", "[DIRECT] The answer is 42.", "direct", []),
    ("[PLAN] with points", "[PLAN]\n1. Sleep\n2. Diet", "plan", ["Sleep", "Diet"]),
    ("[PLAN] with points run together", "[PLAN] 1. Sleep 2. Diet 3. Move", "plan", ["Sleep", "Diet", "Move"]),
    ("tags are case-insensitive and may be bold", "**[plan]**\n1) Sleep\n2) Diet", "plan", ["Sleep", "Diet"]),
    ("[PLAN] with one point goes direct", "[PLAN]\n1. Sleep", "direct", []),
    ("[PLAN] with nothing after it", "[PLAN]", "error", []),
    ("no tag goes direct, the safe way", "1. Sleep\n2. Diet", "direct", []),
    ("empty", "  ", "error", []),
    ("no tag and no words", "?!", "error", []),
]


@pytest.mark.parametrize("name, text, kind, titles", PLAN_DIRECT_CASES, ids=[c[0] for c in PLAN_DIRECT_CASES])
def test_parse_plan_direct(name, text, kind, titles):
    plan = parse_plan_direct(text)
    assert plan.kind == kind, plan.reason
    assert [p.title for p in plan.points] == titles


RESTATE_CASES = [
    # (question, skeleton, titles kept): a title that only says the question again is dropped
    ("Give me three tips for staying healthy.", "1. Staying healthy\n2. Eat vegetables\n3. Sleep\n4. Walk daily",
     ["Eat vegetables", "Sleep", "Walk daily"]),
    ("What should I pack for a weekend hiking trip?", "1. Weekend hiking trip\n2. Hiking boots\n3. Water",
     ["Hiking boots", "Water"]),
    ("Compare cats and dogs as pets.", "1. Cats\n2. Dogs\n3. Cats and dogs as pets\n4. Costs",
     ["Cats", "Dogs", "Costs"]),  # a part of the question is a point; all of it is not
    ("Explain photosynthesis.", "1. Photosynthesis\n2. Light reactions\n3. Calvin cycle",
     ["Light reactions", "Calvin cycle"]),
]


@pytest.mark.parametrize("question, text, titles", RESTATE_CASES, ids=[c[0][:30] for c in RESTATE_CASES])
def test_a_title_that_restates_the_question_is_dropped(question, text, titles):
    plan = parse_skeleton(text, 8, question)
    assert [p.title for p in plan.points] == titles, plan.reason
    assert parse_skeleton(text, 8).kind == "plan"  # without the question, nothing to restate


COUNT_CASES = [
    # (question, points it asks for)
    ("Give me three tips for staying healthy.", 3),
    ("List 5 specific artworks and associated ideas.", 5),
    ("Describe five key principles in evaluating an argument in analytical writing.", 5),
    ("You have been tasked with designing a solar-powered water heating system. Design a five-step workflow.", 5),
    ("How have the Alps and Rhine River influenced settlement? List three impacts.", 3),
    ("What are the top 10 books of the century?", 10),
    ("Name four benefits of cycling to work.", 4),
    ("Imagine you are writing a blog post comparing two popular smartphone models.", None),  # two things, not points
    ("Where do the two novels part ways?", None),  # "ways" two words on: the novels' own verb, not points
    ("David has three sisters. Each of them has one brother. How many brothers does David have?", None),
    ("Write a story in 200 words.", None),
    ("Duration: 3 class periods (each lasts for 45 minutes).", None),
    ("How do I start running?", None),
    ("Give me 40 ideas.", None),  # more than a plan holds: the plan's own cap
]


@pytest.mark.parametrize("question, count", COUNT_CASES, ids=[c[0][:30] for c in COUNT_CASES])
def test_asked_count(question, count):
    assert asked_count(question) == count


def test_a_question_that_names_its_count_gets_that_many_points():
    """The skeleton prompt asks for that many and SPARE more, the skeleton stops past them, the
    parser keeps as many (more than max_points too, up to 12 asked), and the merge shows the
    first that many that say something."""
    fmt, params = load_format("sot"), SamplingParams(max_tokens=500)
    assert "exactly 3 points" in fmt.skeleton_user.format(question="q", points=fmt.points_counted.format(count=3))
    assert "of 3 to 8 points" in fmt.skeleton_user.format(question="q", points=fmt.points)
    assert points_asked("Give me three tips.") == 3 + SPARE and points_asked("How?") is None
    counted = skeleton_params(SoTConfig(), params, points_asked("Give me three tips."))
    assert counted.stop[0] == f"\n{3 + SPARE + 1}." and not counted.stop_repeated_item  # it goes on past a repeat
    assert skeleton_params(SoTConfig(), params).stop[0] == "\n9."
    flow = Flow(SoTConfig(max_points=4))
    ten = "\n".join(f"{n}. Point {n}" for n in range(1, 15))
    for question, want in [("Give me three tips.", 3 + SPARE), ("What are the top 10 books?", 10 + SPARE), ("How?", 4)]:
        planned = flow.parse(Skeleton("r", question, SamplingParams(), "sot", "", ten, {}))
        assert len(planned.points) == want, question
    # Fewer distinct points than the question names: a plan of those it has.
    short = flow.parse(Skeleton("r", "Give me three tips.", SamplingParams(), "sot", "", "1. Water\n2. Map\n3. Water", {}))
    assert short.mode == "sot" and [t for _, t, _ in short.points] == ["Water", "Map"] and short.count == 0
    many = Plan("plan", [Point(n, f"Point {n}") for n in range(1, 11)])
    assert "\n11." in point_params(SoTConfig(), params, many).stop  # a point ends where an eleventh would begin
    texts = ["", " Carry water.", " Pack a map.", " Wear boots.", " Bring a hat."]  # the first says nothing
    points = [(n, f"T{n}", text) for n, text in enumerate(texts, 1)]
    assert fmt.merge(points, "Give me three tips for a hike.") == "1. T2: Carry water.\n2. T3: Pack a map.\n3. T4: Wear boots."
    assert dropped_points(points, "Give me three tips for a hike.") == [1, 5]


OVERLAP_CASES = [
    # (a, b, same point)
    ("Upgrade your living room", "Living room upgrades", True),
    ("Sunscreen daily", "Wear sunscreen daily", True),
    ("Train seats", "Comfortable train seats", True),
    ("Aria", "Aria's voice", False),  # a topic the points name, not the same point
    ("Hiking boots", "Hiking socks", False),
    ("Day 1", "Day 2", False),
    ("Cost", "Costs", True),
    ("Sleep", "Diet", False),
]


@pytest.mark.parametrize("a, b, same", OVERLAP_CASES)
def test_same_point(a, b, same):
    assert same_point(a, b) is same and same_point(b, a) is same


def test_content_words_say_what_a_text_is_about():
    assert content_words("Give me three tips for staying healthy!") == {"3", "stay", "healthy"}
    assert content_words("The cities' parks, and a city park.") == {"city", "park"}
    assert restates("Staying healthy", "Give me three tips for staying healthy.")
    assert not restates("Eat well", "Give me three tips for staying healthy.")
    assert says_nothing("  ", "q", "Title") and says_nothing(" Staying healthy is staying healthy.", "How to stay healthy?", "Tips")
    assert not says_nothing(" Eat more vegetables.", "How to stay healthy?", "Diet")


def test_max_points_below_two_is_a_user_error():
    with pytest.raises(SpecSotError, match="max_points"):
        parse_skeleton("1. a\n2. b", max_points=1)


def test_prompt_formats_are_data_files_with_their_parser_and_stops():
    sot, plan = load_format("sot"), load_format("plan")
    assert sot.skeleton_prefix == "1." and sot.plan("1. a\n2. b", 8).kind == "plan"
    assert plan.skeleton_prefix == "[" and plan.skeleton_stop == ("DIRECT]",)
    assert plan.plan("[DIRECT]", 8).kind == "direct" and sot.plan("[DIRECT]", 8).kind == "direct"
    assert [p.predicted_tokens for p in plan.plan("[PLAN]\n1. a (~30 tokens)\n2. b (~50 tokens)", 8).points] == [30, 50]
    params = SamplingParams(max_tokens=500)
    assert skeleton_params(SoTConfig(prompt_format="plan"), params).stop == ("\n9.", "DIRECT]")
    assert skeleton_params(SoTConfig(), params).stop == ("\n9.", "\n\n")  # the list ends at a blank line
    with pytest.raises(SpecSotError, match="unknown prompt format 'nope': use one of plan, sot, or a format file"):
        SoTConfig(prompt_format="nope")


def test_a_user_s_own_format_file_is_read_by_its_path_and_a_bad_one_is_named(tmp_path, monkeypatch):
    """--prompt-format takes a format file's path (a copy of sot.json changed); SoTConfig holds it
    resolved, so every stage process reads the same file. A missing file, a missing template or a
    misspelt placeholder fails at once, saying what to fix."""
    shipped = json.loads((FOLDER / "sot.json").read_text())
    mine = dict(shipped, name="mine", point=dict(shipped["point"], user="Q: {question}\nPlan:\n{skeleton}\nBe brief."))
    (tmp_path / "mine.json").write_text(json.dumps(mine))
    monkeypatch.chdir(tmp_path)
    config = SoTConfig(prompt_format="mine.json")
    assert config.prompt_format == str(tmp_path / "mine.json")  # resolved where it was given
    fmt = load_format(config.prompt_format)
    assert fmt.name == "mine" and fmt.point_user.endswith("Be brief.") and fmt.examples == load_format("sot").examples
    assert Flow(config).format is fmt
    with pytest.raises(SpecSotError, match="prompt format file .*/gone.json not found"):
        SoTConfig(prompt_format="gone.json")
    (tmp_path / "nouser.json").write_text(json.dumps(dict(shipped, point={"assistant_prefix": "{index}."})))
    with pytest.raises(SpecSotError, match="lacks 'user'.*point.user"):
        load_format(str(tmp_path / "nouser.json"))
    (tmp_path / "typo.json").write_text(json.dumps(dict(shipped, counted_direct="{question} ({cuont})")))
    with pytest.raises(SpecSotError, match="counted_direct has a bad placeholder.*cuont.*its fields are {question}, {count}"):
        load_format(str(tmp_path / "typo.json"))
    # a field that another template has is no field of this one: the skeleton's request has no {title}
    (tmp_path / "other.json").write_text(json.dumps(dict(shipped, skeleton=dict(shipped["skeleton"], user="{title}"))))
    with pytest.raises(SpecSotError, match="skeleton.user has a bad placeholder.*title"):
        load_format(str(tmp_path / "other.json"))
    (tmp_path / "number.json").write_text(json.dumps(dict(shipped, counted_direct=7)))
    with pytest.raises(SpecSotError, match="counted_direct must be a string, got 7"):
        load_format(str(tmp_path / "number.json"))
    (tmp_path / "broken.json").write_text("{")
    with pytest.raises(SpecSotError, match="broken.json cannot be read"):
        load_format(str(tmp_path / "broken.json"))


def test_the_format_s_own_stop_stays_in_the_skeleton_text():
    """The plan format stops on "DIRECT]" (the model's decision, kept); other stops are dropped."""
    plan, sot = load_format("plan"), load_format("sot")
    assert skeleton_text(plan, Delta("", [7], "stop", "DIRECT]")) == "DIRECT]"
    assert skeleton_text(sot, Delta("x", [7], "stop", "\n9.")) == "x"
    assert skeleton_text(sot, Delta("x", [7], "stop", "\n\n")) == "x"  # the format's own, but no decision
    assert skeleton_text(plan, Delta("ab", [7])) == "ab"


CUT = "1. Hawaii: beaches\n2. Food: poke\n3. Adventure: a mix of"


@pytest.mark.parametrize(
    "finish, titles",
    [
        ("length", ["Hawaii: beaches", "Food: poke"]),  # the cap cut point 3 mid-line: it is left out
        ("repeat", ["Hawaii: beaches", "Food: poke"]),  # a loop was cut off: the same
        ("stop", ["Hawaii: beaches", "Food: poke", "Adventure"]),  # the list ended: all kept (a head, _head)
    ],
)
def test_an_unfinished_last_line_of_a_cut_skeleton_is_not_a_point(finish, titles):
    plan = load_format("sot").plan(finished_lines(CUT, finish), 8)
    assert [p.title for p in plan.points] == titles
    assert finished_lines("1. one line", "length") == "1. one line"  # nothing before it to keep
    assert finished_lines("1. a 2. b 3. c and", "length") == "1. a 2. b"  # items run on in one line
    # a number inside a title is not an item (the parser's rule): the whole unfinished line goes
    assert finished_lines("1. a\n2. b\n3. Pick 3. options and", "length") == "1. a\n2. b"


def test_a_skeleton_that_lists_its_point_again_inside_one_line_goes_direct():
    """SmolLM2-135M on an MT-bench question wrote its one point, then "1." and the point again, "2."
    and the point again, ... on one line up to the skeleton's cap. The skeleton's loop stop ends it
    at the first repeat; the parser is left one point, not a plan."""
    point = " The stages of life shape our understanding of time and mortality:"
    looped = "1." + point + " 1." + point + " 2." + point + " 3." + point
    watch_params = skeleton_params(SoTConfig(), SamplingParams())
    assert watch_params.stop_repeated_line and watch_params.stop_repeated_item
    watch = LineWatch(items=True)
    text = looped[2:]  # the output (the prompt prefilled "1.")
    fed = next(i for i in range(1, len(text) + 1) if watch.add(text[i - 1]))
    skeleton = "1." + text[:fed]
    assert skeleton == "1." + point + " 1." + point + " 2. "  # ended as the repeated item finished
    plan = load_format("sot").plan(finished_lines(skeleton, "repeat"), 8)
    assert plan.kind == "direct" and "only 1 usable point" in plan.reason


def test_phases_keep_the_request_s_repeat_stop():
    params = SamplingParams(max_tokens=300, repeat_stop=16)
    assert skeleton_params(SoTConfig(), params).repeat_stop == 16
    assert skeleton_params(SoTConfig(), params).max_line_chars == SKELETON_LINE_CHARS  # a paragraph is no point
    assert point_params(SoTConfig(), params, Plan("plan", [Point(1, "a"), Point(2, "b")])).max_line_chars == 0
    assert point_params(SoTConfig(), params, Plan("plan", [Point(1, "a"), Point(2, "b")])).repeat_stop == 16


def test_a_point_ends_at_its_paragraph_at_a_new_numbered_line_or_where_it_restates_the_plan():
    plan = Plan("plan", [Point(1, "Brand comparison"), Point(2, "Performance")])
    got = point_params(SoTConfig(), SamplingParams(max_tokens=300, stop=("END",)), plan)
    assert got.max_tokens == 160 and got.stop_after_text and got.stop_repeated_line
    assert {"END", "\n\n", "\n1.", "\n9.", "1. Brand comparison", "2. Performance"} <= set(got.stop)


ALPHABET = list("1234567890.)(][~*_`#>-: \n\t\r") + list("abcXYZ")
ALPHABET += ["tokens", "**", "\u200b", "é", "漢", "\x00", "🙂"]


@pytest.mark.parametrize("parse", [parse_skeleton, parse_plan_direct])
def test_parsers_never_raise_and_keep_their_promises(parse):
    rng = random.Random(1234)
    for _ in range(3000):
        text = "".join(rng.choice(ALPHABET) for _ in range(rng.randint(0, 80)))
        if rng.random() < 0.3:
            text = rng.choice(["1.", "[PLAN]\n1.", "[DIRECT]"]) + text
        plan = parse(text, max_points=5)
        assert plan.kind in ("plan", "direct", "error"), text
        if plan.kind != "plan":
            assert plan.points == [] and plan.reason, text
            continue
        assert 2 <= len(plan.points) <= 5, text
        assert [p.index for p in plan.points] == list(range(1, len(plan.points) + 1)), text
        titles = [p.title.casefold() for p in plan.points]
        assert len(set(titles)) == len(titles), text
        for p in plan.points:
            assert any(c.isalpha() for c in p.title) and len(p.title.split()) <= 12, text
            assert p.title == p.title.strip(), text
            assert p.predicted_tokens is None or p.predicted_tokens > 0, text


PASSAGE = ("It was a cold morning in the valley, and the river ran high with the melted snow of the spring. "
           "The villagers gathered at the bridge to watch the water rise, some worried, some merely curious, "
           "and the old miller said he had never seen it so high.")

ROUTE_CASES = [
    # (question, goes SoT) -- the mt_bench category in the comment where it comes from there
    ("What are the main benefits of regular exercise?", True),
    ("Explain how vaccines train the immune system.", True),
    ("Give me five tips for staying focused while working from home.", True),
    ("Compare renting and buying a house.", True),
    ("Write a blog post about sustainable travel.", True),
    ("Can you explain how a bill becomes law?", True),
    ("Compose an engaging travel blog post about a recent trip to Hawaii, highlighting cultural experiences and "
     "must-see attractions.", True),  # writing
    ("In the field of quantum physics, what is superposition, and how does it relate to the phenomenon of "
     "quantum entanglement?", True),  # stem
    ("Please describe the concept of machine learning. Could you elaborate on the differences between supervised, "
     "unsupervised, and reinforcement learning? Provide real-world examples of each.", True),  # stem
    ("Discuss antitrust laws and their impact on market competition. Compare the antitrust laws in US and China "
     "along with some case studies.", True),  # humanities
    ("What are some business etiquette norms when doing business in Japan?", True),  # humanities
    ("Given that f(x) = 4x^3 - 9x - 14, find the value of f(2).", False),  # math
    ("When rolling two dice, what is the probability that you roll a total number that is at least 3?", False),  # math
    ("How many integers are in the solution of the inequality |x + 5| < 10", False),  # math
    ("Calculate the compound interest on a loan.", False),
    ("Prove that the square root of 2 is irrational.", False),
    ("Write a C++ program to find the nth Fibonacci number using recursion.", False),  # coding
    ("Implement a function to find the median of two sorted arrays.", False),  # coding
    ("Why does this crash?\n```\nx = [1, 2]\nprint(x[5])\n```", False),
    ("Write a regex that matches email addresses.", False),
    ("Who wrote Hamlet?", False),
    ("What is the capital of France?", False),
    ("Is it safe to eat raw cookie dough?", False),
    ("Translate 'good morning' into Japanese.", False),
    ("What do you make of my opening:\n\n" + PASSAGE, False),
    ("Rewrite your previous response. Start every sentence with the letter A.", False),  # writing, turn 2
    ("Edit the following paragraph to correct any grammatical errors: She didn't remembre where is her purse.", False),
    ("Extract the following information from the presented texts: the name of the book and the author.", False),
    ("Identify the countries, their capitals, and the languages spoken in the following sentences. Output in JSON "
     "format.", False),  # extraction
]


@pytest.mark.parametrize("question, use_sot", ROUTE_CASES, ids=[q[:40] for q, _ in ROUTE_CASES])
def test_the_fallback_rules(question, use_sot):
    """The pattern rules that route where the learned router cannot (a model whose representation
    does not separate the labels)."""
    decision = rule_route(question)
    assert decision.use_sot == use_sot, decision.reason
    assert decision.reason


SHORT_CASES = [
    # (question, a short answer is asked for)
    ("In one sentence, what is photosynthesis?", True),
    ("Explain what a mortgage is in under 50 words.", True),
    ("Give me a one-line definition of inflation.", True),
    ("Briefly, what does a project manager do?", True),
    ("Summarize the plot of Romeo and Juliet in two sentences.", True),
    ("Describe a vivid character. Please answer in fewer than 200 words.", False),  # long enough to plan
    ("Explain how vaccines train the immune system.", False),
    ("Write a story with one line of dialogue per character.", True),
    ("Give me three tips for staying healthy.", False),
]


@pytest.mark.parametrize("question, short", SHORT_CASES, ids=[q[:40] for q, _ in SHORT_CASES])
def test_a_short_answer_goes_direct_because_planning_would_be_slower(question, short):
    why = short_answer(question)
    assert (why is not None) is short
    if short:
        assert why.startswith("direct, because planning would be slower")
        assert rule_route(question).use_sot is False


def test_auto_asks_the_router_it_is_given():
    asked = []
    router = lambda q: asked.append(q) or Route(q.endswith("?"), "stub")  # noqa: E731
    assert route("How?", "auto", router).use_sot and not route("Do.", "auto", router).use_sot
    assert asked == ["How?", "Do."]
    with pytest.raises(SpecSotError, match="needs the model's router"):
        route("How?", "auto")  # no model here to route by


@pytest.mark.parametrize("mode, use_sot", [("always", True), ("never", False)])
def test_route_forced_modes(mode, use_sot):
    assert route("What is 2 + 2?", mode).use_sot is use_sot
    assert route("Explain photosynthesis.", mode).use_sot is use_sot


def test_unknown_route_mode_names_the_flag():
    with pytest.raises(SpecSotError, match=r"--sot must be one of auto, always, never"):
        route("Hi", "sometimes")
    with pytest.raises(SpecSotError, match=r"--sot must be one of auto, always, never"):
        Flow(SoTConfig()).prompt_size(Ask("r", "Hi", SamplingParams(), "sometimes"))


def points(*lengths):
    """Points 1..n with the given predicted lengths (None: the default)."""
    return [Point(n, f"p{n}", length) for n, length in enumerate(lengths, 1)]


def device(name, compute, max_parallel=8):
    return DeviceProfile(name, compute, 16.0, 500.0, max_parallel)


SCHEDULE_CASES = [
    # (name, points, devices, default_tokens, [(device, point indices, predicted seconds)])
    ("one device takes everything, longest first", points(10, 30, 20), [device("a", 10)], 64,
     [("a", [2, 3, 1], 6.0)]),
    ("unknown lengths take the default", points(None, 100), [device("a", 10)], 50, [("a", [2, 1], 15.0)]),
    ("a device twice as fast takes twice the work", points(40, 40, 40), [device("slow", 10), device("fast", 20)], 64,
     [("slow", [2], 4.0), ("fast", [1, 3], 4.0)]),
    ("a much faster device takes everything", points(10, 10), [device("cpu", 1), device("gpu", 100)], 64,
     [("cpu", [], 0.0), ("gpu", [1, 2], 0.2)]),
    ("LPT balances a classic example exactly", points(5, 8, 3, 7, 4, 6, 2, 1), [device("a", 1), device("b", 1)], 64,
     [("a", [2, 1, 5, 8], 18.0), ("b", [4, 6, 3, 7], 18.0)]),
    # the textbook case where greedy LPT is not optimal: 7 against the best 6 (3+3 | 2+2+2)
    ("LPT is greedy, not optimal", points(3, 3, 2, 2, 2), [device("a", 1), device("b", 1)], 64,
     [("a", [1, 3, 5], 7.0), ("b", [2, 4], 5.0)]),
    ("ties go to the earlier point and the earlier device", points(5, 5, 5, 5), [device("a", 1), device("b", 1),
                                                                                  device("c", 1)], 64,
     [("a", [1, 4], 10.0), ("b", [2], 5.0), ("c", [3], 5.0)]),
    ("no points: every device gets an empty assignment", [], [device("a", 1), device("b", 2)], 64,
     [("a", [], 0.0), ("b", [], 0.0)]),
    ("no points and no devices", [], [], 64, []),
]


@pytest.mark.parametrize("name, pts, devices, default_tokens, expected", SCHEDULE_CASES,
                         ids=[c[0] for c in SCHEDULE_CASES])  # fmt: skip
def test_schedule(name, pts, devices, default_tokens, expected):
    got = schedule(pts, devices, default_tokens)
    assert [(a.device, a.point_indices, pytest.approx(a.predicted_seconds)) for a in got] == expected


def test_schedule_is_deterministic():
    rng = random.Random(7)
    pts = points(*[rng.choice([None, 10, 20, 40, 80]) for _ in range(30)])
    devices = [device("a", 40), device("b", 200), device("c", 200), device("d", 700)]
    assert schedule(pts, devices) == schedule(list(pts), list(devices))


@pytest.mark.parametrize("pts, devices, message", [
    (points(1), [], "no devices"),
    (points(1), [device("a", 1), device("a", 2)], "listed twice"),
])  # fmt: skip
def test_schedule_user_errors(pts, devices, message):
    with pytest.raises(SpecSotError, match=message):
        schedule(pts, devices)


GOOD = {
    "profiles": {
        "cpu": {"compute": 40, "memory_gb": 23, "bandwidth_gb_s": 20, "max_parallel": 8},
        "cuda": {"compute": 200, "memory_gb": 24, "bandwidth_gb_s": 900, "max_parallel": 32},
        "h100": {"compute": 700, "memory_gb": 80, "bandwidth_gb_s": 3350, "max_parallel": 64},
    },
    "devices": {"127.0.0.1#cpu": "cpu", "10.0.0.2#0": "h100"},
}


def write(tmp_path, data):
    path = tmp_path / "devices.json"
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    return path


def changed(edit):
    """GOOD, deep-copied, after edit(data)."""
    data = json.loads(json.dumps(GOOD))
    edit(data)
    return data


PROFILE_ERRORS = [
    # (name, file contents, words the message must contain)
    ("not JSON", "{profiles: }", "not valid JSON"),
    ("no profiles", {"devices": {}}, '"profiles" object'),
    ("an unknown top-level key", changed(lambda d: d.update(device={})), "unknown key 'device'"),
    ("a missing field", changed(lambda d: d["profiles"]["cuda"].pop("compute")), "'cuda' is missing 'compute'"),
    ("an unknown field", changed(lambda d: d["profiles"]["cpu"].update(speed=3)), "unknown field 'speed'"),
    ("a negative number", changed(lambda d: d["profiles"]["h100"].update(memory_gb=-80)),
     "'memory_gb' must be positive"),
    ("zero compute", changed(lambda d: d["profiles"]["cpu"].update(compute=0)), "'compute' must be positive"),
    ("a string for a number", changed(lambda d: d["profiles"]["cpu"].update(compute="fast")), "must be a number"),
    ("a fractional max_parallel", changed(lambda d: d["profiles"]["cpu"].update(max_parallel=2.5)),
     "whole number"),
    ("a device with an unknown profile", changed(lambda d: d["devices"].update({"10.0.0.3#1": "h300"})),
     "'10.0.0.3#1' uses profile 'h300'"),
    ("a device name without #", changed(lambda d: d["devices"].update({"gpu0": "h100"})), "'gpu0' is not of the form"),
]


@pytest.mark.parametrize("name, contents, message", PROFILE_ERRORS, ids=[c[0] for c in PROFILE_ERRORS])
def test_devices_file_mistakes(tmp_path, name, contents, message):
    with pytest.raises(SpecSotError, match=message) as error:
        load_profiles(write(tmp_path, contents))
    assert str(tmp_path) in str(error.value)


def test_missing_devices_file(tmp_path):
    with pytest.raises(SpecSotError, match="does not exist"):
        load_profiles(tmp_path / "nope.json")


def profile_of(name: str, profiles):
    return device_profiles(parse_devices(name, resolve=False), profiles)[0]


@pytest.mark.parametrize("name, profile, compute", [
    ("127.0.0.1#cpu", "cpu", 40.0),   # mapped exactly
    ("10.0.0.2#0", "h100", 700.0),    # mapped exactly, ahead of the cuda fallback
    ("10.0.0.9#cpu", "cpu", 40.0),    # #cpu falls back to the cpu profile
    ("10.0.0.9#3", "cuda", 200.0),    # #N falls back to the cuda profile
])  # fmt: skip
def test_device_profiles_resolve_devices(tmp_path, name, profile, compute):
    resolved = profile_of(name, load_profiles(write(tmp_path, GOOD)))
    assert (resolved.name, resolved.compute) == (name, compute)


def test_device_without_a_fallback_profile(tmp_path):
    profiles = load_profiles(write(tmp_path, changed(lambda d: d["profiles"].pop("cuda"))))
    with pytest.raises(SpecSotError, match="'10.0.0.9#0' has no profile: add a \"cuda\" profile"):
        profile_of("10.0.0.9#0", profiles)


def test_the_shipped_devices_file_loads_and_covers_cpu_and_cuda():
    profiles = load_profiles(default_profiles_path())
    assert {"cpu", "cuda", "h100", "h200"} <= set(profiles)
    assert profile_of("127.0.0.1#cpu", profiles).max_parallel == 8
    gpu = profile_of("127.0.0.1#0", profiles)  # a GPU device falls back to the cuda profile
    assert (gpu.compute, gpu.memory_gb) == (profiles["cuda"].compute, profiles["cuda"].memory_gb)
    assert gpu.compute > profiles["cpu"].compute  # one unit for every profile: decode tokens/s


@pytest.mark.parametrize("name", ["sot", "plan"])
def test_the_ordered_answer_streams_exactly_the_merged_answer(name):
    """Points growing and ending in any order and any way (stopped, cut by their cap or their loop
    stop), with sentences, blank lines, repeated lines, trailing space and nothing to say, then
    (a counted answer short of its count) those it left out written again and growing the same
    way: what is released is never taken back (it only grows), and the pieces joined are the
    format's merge of the plan's points and those written again."""
    fmt = load_format(name)
    rng = random.Random(0)
    pieces = ["a", "b", " ", "\n", "x y", "\n\n", "A", "  ", "1. a", ". ", "Go.", "q", "!", "T", " dry", " feet"]
    rounds = 0
    for _ in range(3000):
        points = [(i + 1, rng.choice(["T", "Two words", "", "Boots"])) for i in range(rng.randint(1, 4))]
        # the counted ones: at most that many points shown, and with no spare left a thin point stays
        question = rng.choice(["", "q?", "Why q b?", "Give two tips?", "Name three things for feet?"])
        ordered, texts, released = OrderedAnswer(fmt, points, question), {i: "" for i, _ in points}, ""
        live, cut, listed = [i for i, _ in points], set(), list(points)
        while live:
            index = rng.choice(live)
            if rng.random() < 0.2:
                live.remove(index)
                finish = rng.choice(["stop", "length", "repeat"])
                cut |= {index} if finish != "stop" else set()
                released += ordered.end(index, finish)
            else:
                text = "".join(rng.choice(pieces) for _ in range(rng.randint(1, 3)))
                texts[index] += text
                released += ordered.add(index, text)
            if not live and (left_out := ordered.again()):  # the second round, once
                rounds += 1
                again = [(len(points) + n, ordered.titles[i]) for n, i in enumerate(left_out, 1)]
                assert asked_count(question) and set(left_out) <= {i for i, _ in points}
                listed += again
                texts |= {i: "" for i, _ in again}
                live = [i for i, _ in again]
                released += ordered.extend(again)
        merged = fmt.merge([(i, t, texts[i]) for i, t in listed], question, cut, len(points))
        assert released == merged, (listed, texts)
        assert ordered.again() == []  # asked once at most
    assert rounds > 100  # the second round ran often


MERGE_CASES = [
    # (name, [(title, text, finish)], merged answer)
    ("every point shown", [("Warm up", " Walk first.", "stop"), ("Shoes", " Buy light ones.", "stop")],
     "1. Warm up: Walk first.\n2. Shoes: Buy light ones."),
    ("an empty point is left out and the next numbered on",
     [("Boots", " Wear boots.", "stop"), ("Sunscreen", "", "stop"), ("Water", " Take two litres.", "stop")],
     "1. Boots: Wear boots.\n2. Water: Take two litres."),
    ("a point that only says its title and the question is left out",
     [("Boots", " Wear boots.", "stop"), ("Packing", " Pack for the hiking trip.", "stop")], "1. Boots: Wear boots."),
    ("a point that only says what an earlier one said is left out",
     [("Boots", " Wear boots on the trail.", "stop"), ("Footwear", " Boots on the trail.", "stop"),
      ("Water", " Take two litres.", "stop")], "1. Boots: Wear boots on the trail.\n2. Water: Take two litres."),
    ("a cut-off point keeps its complete sentences",
     [("Boots", " Wear boots. They keep feet dry and", "length"), ("Water", " Drink.", "stop")],
     "1. Boots: Wear boots.\n2. Water: Drink."),
    ("a cut-off point without a complete sentence is left out",
     [("Boots", " Wear boots that keep", "length"), ("Water", " Drink.", "repeat")], "1. Water: Drink."),
    ("no point worth reading: every point as it wrote it, rather than no answer",
     [("Boots", " Wear boots that keep", "length"), ("Sunscreen", "", "stop"), ("Water", " Drink water and", "length")],
     "1. Boots: Wear boots that keep\n2. Water: Drink water and"),
    ("a point that opens on a new line goes on after its head (a list: on the next line, test_sot_engine)",
     [("Boots", "\n\nWear boots.", "stop"), ("Water", " \nTake two litres.", "stop")],
     "1. Boots: Wear boots.\n2. Water: Take two litres."),
    ("a point that stopped unfinished keeps what it wrote",
     [("Boots", " Wear boots that keep", "stop"), ("Water", " Drink", "stop")],
     "1. Boots: Wear boots that keep\n2. Water: Drink"),
]


@pytest.mark.parametrize("name, points, answer", MERGE_CASES, ids=[c[0] for c in MERGE_CASES])
def test_the_merged_answer_shows_only_points_worth_reading(name, points, answer):
    fmt, question = load_format("sot"), "What should I pack for a weekend hiking trip?"
    indexed = [(i, title, text) for i, (title, text, _) in enumerate(points, 1)]
    cut = {i for i, (_, _, finish) in enumerate(points, 1) if finish != "stop"}
    assert fmt.merge(indexed, question, cut) == answer
    dropped = dropped_points(indexed, question, cut)
    assert len(points) - len(dropped) == answer.count("\n") + 1


def test_a_counted_answer_with_no_spare_left_shows_a_thin_point_that_names_an_item_of_its_own():
    """Where the question names a count, a point whose text only says what an earlier one said is
    left out while a spare can stand in for it; once none can, its own title keeps it in, so the
    answer is not short of its count, unless its text copies the earlier one's (without naming its
    own item). A point that says
    nothing beyond its title and the question stays out either way. Such a point streams only once
    it ended (its text may yet turn into a copy)."""
    fmt, question = load_format("sot"), "Name two things to pack for a hiking trip."
    boots, water = ("Boots", " Boots keep your feet dry on the trail."), ("Water", " Keep dry on the trail.")
    spare = ("Snacks", " Nuts give quick energy.")
    cases = [
        ([boots, water], "1. Boots: Boots keep your feet dry on the trail.\n2. Water: Keep dry on the trail."),
        ([boots, water, spare], "1. Boots: Boots keep your feet dry on the trail.\n2. Snacks: Nuts give quick energy."),
        ([boots, ("Socks", " Keep your feet dry on the trail.")], "1. Boots: Boots keep your feet dry on the trail."),
        # the same words, but naming its own item: no copy ("fish is a great choice" after "lean beef is")
        ([boots, ("Socks", " Socks keep your feet dry on the trail.")],
         "1. Boots: Boots keep your feet dry on the trail.\n2. Socks: Socks keep your feet dry on the trail."),
        ([boots, ("Packing", " Pack for the hiking trip.")], "1. Boots: Boots keep your feet dry on the trail."),
    ]
    for points, answer in cases:
        indexed = [(i, title, text) for i, (title, text) in enumerate(points, 1)]
        assert fmt.merge(indexed, question) == answer
        ordered = OrderedAnswer(fmt, [(i, title) for i, title, _ in indexed], question)
        streamed = "".join(ordered.add(i, text) + ordered.end(i) for i, _, text in indexed)
        assert streamed == answer
    ordered = OrderedAnswer(fmt, [(1, boots[0]), (2, water[0])], question)
    assert ordered.add(1, boots[1]) + ordered.end(1) == "1. Boots: Boots keep your feet dry on the trail."
    assert ordered.add(2, " Keep dry. On the trail. ") == ""  # it would be a copy with "your feet"
    assert ordered.end(2) == "\n2. Water: Keep dry. On the trail."
    # The same two points for a question without a count: the second says nothing new.
    assert fmt.merge([(1, *boots), (2, *water)], "What should I pack for a hiking trip?").count("\n") == 0


def test_the_ordered_answer_holds_what_may_change():
    """Nothing of a later point comes before the points ahead of it end; a point's head waits for
    the first of its text that says something, and its text for the end of its sentence."""
    fmt = load_format("sot")
    ordered = OrderedAnswer(fmt, [(1, "One"), (2, "Two"), (3, "Three")], "Count to three?")
    assert ordered.add(2, " a banana") == ""  # point 1 comes first
    assert ordered.add(1, " ") == ""  # point 1 has said nothing yet
    assert ordered.add(1, "first item") == ""  # its sentence may yet be cut
    assert ordered.add(1, ". Then") == "1. One: first item."
    assert ordered.end(1, "length") == ""  # the cut sentence never shows; point 2's sentence is unfinished
    assert ordered.end(2) == "\n2. Two: a banana"  # it stopped there: all of it
    assert ordered.add(3, " Three.") == "" and ordered.end(3) == ""  # says only its title and the question


def test_the_summary_counts_the_points_shown():
    from specsot_mq.messages import Answer
    from specsot_mq.sot.flow import summary

    points = [(i, f"T{i}", "text") for i in range(1, 6)]
    stats = {"skeleton": {"tokens": 20, "steps": 10, "seconds": 0.1}, "dropped_points": [4, 5], "seconds": 1.0}
    line = summary(Answer("r", "...", "sot", "planned", "1. T1", points, stats, "stop"))
    assert line.startswith("mode sot · 3 points (2 left out) · 20 tokens · 1.00 s · 20.0 tok/s · tau skeleton 2.00")
    points.append((6, "T4", "text again"))  # point 4 written again
    stats |= {"dropped_points": [4, 5], "written_again": [6]}
    line = summary(Answer("r", "...", "sot", "planned", "1. T1", points, stats, "stop"))
    assert line.startswith("mode sot · 4 points (2 left out), 1 written again · 20 tokens")


def test_the_ordered_answer_names_the_points_it_will_never_show():
    fmt = load_format("sot")
    ordered = OrderedAnswer(fmt, [(i, f"T{i}") for i in range(1, 6)], "Give me two tips for a hike.")
    assert ordered.add(3, " Carry water.") == "" and ordered.unneeded() == []
    ordered.add(1, " Wear boots.")
    ordered.end(1)
    assert ordered.unneeded() == []  # one shown of two
    ordered.end(2)  # said nothing: left out
    assert ordered.end(3) == "\n2. T3: Carry water." and ordered.unneeded() == [4, 5]



class ScriptedGenerator:
    """What SoTEngine asks of a Generator, each job's output scripted by its prompt: the text
    `script` gives for its ids, in one piece, then its end (no model)."""

    def __init__(self, tokenizer, script):
        self.tokenizer, self.script, self.draft, self.prompts = tokenizer, script, None, []
        self.cache = type("Cache", (), {"num_slots": 8, "capacity": 4096})()

    def keep_prefix(self, ids):
        pass

    def new_decoder(self, params):
        return None

    def run_jobs(self, jobs, decoder, max_parallel=None, cancelled=None):
        for job in jobs:
            self.prompts.append(job.ids)
            text = self.script(job.ids)
            yield job.key, Delta(text, self.tokenizer.encode(text, add_special_tokens=False))
            yield job.key, Delta("", [], "stop")


def test_a_counted_answer_short_of_its_count_has_the_points_it_left_out_written_again(default_model_dir):
    """A question naming three points, whose second point says nothing: once every point ended,
    that point is written again from the format's point.user_again prompt (the question and its
    title), and shown third, numbered on; the streamed answer is the merged one, the client is
    told (Again) and the stats name it. An uncounted question's empty point is only left out."""
    from specsot_mq.messages import Again, Answer, AnswerText
    from specsot_mq.sot.engine import SoTEngine
    from specsot_mq.tokenizer import load_tokenizer

    tok, fmt = load_tokenizer(default_model_dir), load_format("sot")
    texts = {"1. Boots:": " Wear boots with a firm grip.", "2. Water:": "", "3. Socks:": " Wool socks stay dry."}

    def script(ids):
        prompt = tok.decode(ids)
        if prompt.endswith(fmt.skeleton_prefix):
            return " Boots\n2. Water\n3. Socks"
        if 'One item of the answer is "Water"' in prompt:
            return " Carry two litres and drink often."
        return next(text for head, text in texts.items() if prompt.endswith(head))

    question = "Give me three tips for a day hike."
    gen = ScriptedGenerator(tok, script)
    events = list(SoTEngine(gen, SoTConfig(sot="always")).stream(question))
    answer = events[-1]
    assert isinstance(answer, Answer) and answer.mode == "sot"
    assert answer.answer == ("1. Boots: Wear boots with a firm grip.\n2. Socks: Wool socks stay dry.\n"
                             "3. Water: Carry two litres and drink often.")  # fmt: skip
    assert "".join(e.text for e in events if isinstance(e, AnswerText)) == answer.answer
    assert [e.points for e in events if isinstance(e, Again)] == [[(4, 2, "Water")]]
    assert answer.stats["written_again"] == [4] and answer.stats["dropped_points"] == [2]
    assert gen.prompts[-1] == fmt.again_ids(tok, question, 2, "Water")
    # the same plan, with no count named: the empty point is left out, nothing is written again
    gen = ScriptedGenerator(tok, script)
    answer = list(SoTEngine(gen, SoTConfig(sot="always")).stream("What helps on a day hike?"))[-1]
    assert answer.answer == "1. Boots: Wear boots with a firm grip.\n2. Socks: Wool socks stay dry."
    assert "written_again" not in answer.stats and len(gen.prompts) == 4
