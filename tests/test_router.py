"""The learned router on the real default model: it trains from the shipped labels, classifies the
labelled validation split well, is cached per model and labels, and answers the way it routes."""

import json

import pytest

from specsot_mq.messages import Ask
from specsot_mq.sampling import SamplingParams
from specsot_mq.sot import learned_router
from specsot_mq.sot.flow import Flow, SoTConfig
from specsot_mq.sot.learned_router import LearnedRouter, cache_path, load_labels

pytestmark = pytest.mark.slow  # the real default model


@pytest.fixture(scope="module")
def real(default_model_dir):
    from specsot_mq.loader import load_generator

    return load_generator(num_slots=1, max_len=512)


@pytest.fixture(scope="module")
def trained(real, tmp_path_factory):
    """The router trained here, from nothing, into a cache of its own."""
    home = tmp_path_factory.mktemp("home")
    return LearnedRouter.for_model(real.model, real.tokenizer, home), home


def test_the_labels_ship_as_data_with_a_validation_split():
    train, valid = load_labels("train"), load_labels("valid")
    assert len(train) >= 400 and len(valid) >= 100
    assert not {r["question"] for r in train} & {r["question"] for r in valid}
    for r in train + valid:
        assert r["label"] in ("plan", "direct") and r["kind"] and r["source"]
    for split in (train, valid):
        assert 0.35 < sum(r["label"] == "plan" for r in split) / len(split) < 0.65
        assert {r["source"].split(":")[0] for r in split} == {"mt_bench", "general_questions", "written"}


def test_the_router_trains_and_classifies_the_validation_split(trained):
    router, _ = trained
    valid = load_labels("valid")
    right = sum((router.p_plan(r["question"]) >= 0.5) == (r["label"] == "plan") for r in valid)
    assert right / len(valid) >= 0.9
    assert router.usable and router.info["valid_accuracy"] == round(right / len(valid), 4)
    assert router.info["train"] == len(load_labels("train")) and router.layer == 15  # half of SmolLM2's 30 layers


ROUTES = [
    # (question, planned, words in the reason)
    ("How can I make my garden attract more birds?", True, "plan"),
    ("What would happen if the oceans were fresh water?", True, "plan"),
    ("What is 17 * 23?", False, "direct"),
    ("Write a Python function that returns the largest of three numbers.", False, "direct"),
    ("Write a poem about a lighthouse.", False, "direct"),
    ("In one sentence, how can I make my garden attract more birds?", False, "direct"),
]


@pytest.mark.parametrize("question, planned, why", ROUTES, ids=[q[:40] for q, _, _ in ROUTES])
def test_routes_on_the_real_model(trained, question, planned, why):
    router, _ = trained
    decision = Flow(SoTConfig(), router=router).decide(Ask("r", question, SamplingParams()))
    assert decision.use_sot is planned and why in decision.reason, decision.reason


def test_the_router_is_cached_per_model_and_labels(trained, real, monkeypatch, tmp_path):
    router, home = trained
    path = cache_path(real.model, home)
    assert path.exists() and path.parent == home / "routers"
    monkeypatch.setattr(LearnedRouter, "train", classmethod(lambda cls, *a: pytest.fail("trained again")))
    again = LearnedRouter.for_model(real.model, real.tokenizer, home)
    assert again.info == router.info
    question = "How should I prepare for a job interview?"
    assert again.p_plan(question) == pytest.approx(router.p_plan(question))
    # Other labels, or another model, have a cache file of their own.
    labels = tmp_path / "labels"
    labels.mkdir()
    rows = load_labels("train")
    rows[0]["label"] = "direct" if rows[0]["label"] == "plan" else "plan"
    (labels / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (labels / "valid.jsonl").write_text((learned_router.LABELS / "valid.jsonl").read_text())
    monkeypatch.setattr(learned_router, "LABELS", labels)
    assert cache_path(real.model, home) != path


def test_another_model_trains_its_own_and_falls_back_where_it_cannot_separate_the_labels(real, tmp_path):
    """A tiny random model: its own cache file; its representation does not separate the labels,
    so the fallback rules route."""
    from conftest import ours_from_hf, tiny_hf

    tiny = ours_from_hf(tiny_hf("llama", vocab_size=len(real.tokenizer), max_position_embeddings=1024))
    assert cache_path(tiny, tmp_path) != cache_path(real.model, tmp_path)
    router = LearnedRouter.for_model(tiny, real.tokenizer, tmp_path)
    assert not router.usable
    decision = router("What is 17 * 23?")
    assert not decision.use_sot and "not used on this model" in decision.reason


def test_a_question_it_would_plan_goes_direct_where_a_short_answer_is_asked(trained, monkeypatch):
    router, _ = trained
    monkeypatch.setattr(router, "p_plan_of", lambda feature: 0.9)
    assert router("How can I attract birds?").use_sot
    decision = router("In one sentence, how can I attract birds?")
    assert not decision.use_sot and decision.reason.startswith("direct, because planning would be slower")


def test_a_question_routed_direct_is_answered_from_the_routers_forward(trained, real, monkeypatch):
    """The router ran the direct prompt half way up: the answer's prefill runs only the layers
    above (layout.resumes), with the draft head's features from both (the default model's head
    reads layers 2, 15, 27 and 30), and answers with the same tokens as a prefill from the start.
    A question cut for the router, whose direct prompt is not the one it ran, starts from the
    start; a short question after it goes on from the router's kept cache, past whose end the
    long one's entries still lie. (The classifier is held to "direct" here: what is checked is
    the prefill.)"""
    from specsot_mq import layout
    from specsot_mq.sot.engine import SoTEngine

    router, _ = trained
    used, resumes = [], layout.resumes

    def spy(resume, *args):
        went_on = resumes(resume, *args)
        if resume is not None:
            used.append(went_on)
        return went_on

    monkeypatch.setattr(layout, "resumes", spy)
    monkeypatch.setattr(router, "p_plan_of", lambda feature: 0.0)  # direct, whatever the question
    params = SamplingParams(max_tokens=24)
    auto = SoTEngine(real, SoTConfig(sot="auto", max_parallel=1), router=router)
    never = SoTEngine(real, SoTConfig(sot="never", max_parallel=1))
    long = "Translate into French: " + "the cat sat on the mat, " * 40
    for question, resumed in (("What is 17 * 23?", [True]), (long, []), ("Name a prime number.", [True])):
        used.clear()
        routed = auto.generate(question, params)
        assert routed.mode == "direct" and used == resumed, routed.stats
        assert routed.answer == never.generate(question, params).answer
