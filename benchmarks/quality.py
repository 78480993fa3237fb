"""Answer quality: the planned answer beside the same model's direct answer, per question, in one run.

For each question (default: benchmarks/general_questions.jsonl and benchmarks/count_questions.jsonl,
the second naming a number of points; count_heldout.jsonl holds 40 more such questions, written
apart, count_check.jsonl 30, written after a change to counted plans, and count_later.jsonl 40,
written before the parser read a head ("Comfort: Soft and supportive") as a title; or
--questions FILE..., MT-bench lines or JSONL with
`question`), the SpecSoT engine answers twice on one generator: with a plan (--sot always, or
auto) and directly (--sot never, EAGLE alone). From the texts alone it reports:

  empty      points in the planned answer with no words after their title
  dup        pairs of points in it whose titles say the same thing (overlap.same_point)
  restate    points in it whose title restates the question or whose text says nothing beyond the
             question and its title (overlap.restates, overlap.says_nothing)
  dropped    points the parser (a duplicate or restating title) and the merge (an empty, cut-off
             or empty-saying text) left out on the way: what the rules above prevented
  again      points a counted answer short of its count wrote again, and of them those it shows
             (written_again_shown in the summary)
  overlap    the most-overlapping pair of points: content-word Jaccard of their texts
  distinct3  distinct word 3-grams over all 3-grams, of each answer (planned / direct)
  coverage   the direct answer's content words that the planned answer holds too
  count      on questions that name a number of points: whether the answer shows exactly that many
             (a planned answer's points; a direct one's distinct numbered items, read as the parser
             reads a skeleton: a repeated or restating item does not count), for the
             planned engine's answers and for the direct ones (count_following, ..._direct;
             --direct-asks-count: the direct engine asks a counted question for its count, with
             the prompt format's counted_direct request)
  route      planned, routed direct (the router's way) or skeleton said direct (a skeleton that was
             no usable list): the median time, direct over planned, of each, in the summary
  tokens     tokens decoded for each answer (all phases), and words in it
  seconds    time to the complete answer, each way

With --judge (a local model folder or name, or an OpenAI-compatible base URL such as
http://127.0.0.1:8080/v1), a pairwise judge compares the two answers in FastChat's pair-v2 manner
(lm-sys/FastChat fastchat/llm_judge: its prompt, both orders, a verdict that changes with the order
counts as a tie). Prints a table per question, a summary, and one JSON line.

    python benchmarks/quality.py [--questions FILE ...] [--limit N] [--per-category N] [--max-tokens 256]
        [--sot always|auto] [--prompt-format sot|plan|FILE.json] [--judge PATH|URL] [--judge-model NAME] [--json-only]
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import time
import urllib.request
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode import add_dtype_option, cpu_name, load_prompts, run_script  # noqa: E402  (a sibling script)

from specsot_mq.errors import SpecSotError  # noqa: E402
from specsot_mq.lookup import History  # noqa: E402
from specsot_mq.sampling import REPEAT_STOP, SamplingParams  # noqa: E402
from specsot_mq.sot.flow import SoTConfig, answer_tokens  # noqa: E402
from specsot_mq.sot.overlap import content_words, jaccard, restates, same_point, says_nothing  # noqa: E402
from specsot_mq.sot.parser import MOST_ASKED, asked_count, item_starts, parse_skeleton  # noqa: E402

HERE = Path(__file__).resolve().parent
DEFAULT_FILES = [HERE / "general_questions.jsonl", HERE / "count_questions.jsonl"]

# FastChat's pairwise judge prompt ("pair-v2", fastchat/llm_judge/data/judge_prompts.jsonl).
JUDGE_SYSTEM = (
    "Please act as an impartial judge and evaluate the quality of the responses provided by two AI assistants to "
    "the user question displayed below. You should choose the assistant that follows the user's instructions and "
    "answers the user's question better. Your evaluation should consider factors such as the helpfulness, "
    "relevance, accuracy, depth, creativity, and level of detail of their responses. Begin your evaluation by "
    "comparing the two responses and provide a short explanation. Avoid any position biases and ensure that the "
    "order in which the responses were presented does not influence your decision. Do not allow the length of the "
    "responses to influence your evaluation. Do not favor certain names of the assistants. Be as objective as "
    "possible. After providing your explanation, output your final verdict by strictly following this format: "
    '"[[A]]" if assistant A is better, "[[B]]" if assistant B is better, and "[[C]]" for a tie.'
)
JUDGE_USER = ("[User Question]\n{question}\n\n[The Start of Assistant A's Answer]\n{answer_a}\n"
              "[The End of Assistant A's Answer]\n\n[The Start of Assistant B's Answer]\n{answer_b}\n"
              "[The End of Assistant B's Answer]")  # fmt: skip
VERDICT = re.compile(r"\[\[([ABC])\]\]")


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None)
    p.add_argument("--draft", default="auto")
    p.add_argument("--questions", type=Path, nargs="+", default=None, help="JSONL files (default: general + count questions)")
    p.add_argument("--limit", type=int, default=100, help="at most N questions from each file")
    p.add_argument("--per-category", type=int, default=0)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--sot", choices=["always", "auto"], default="always", help="how the planned answer is routed")
    p.add_argument("--prompt-format", default="sot",
                   help="the planned answer's prompt format: sot, plan, or a format file's path (.json)")
    p.add_argument("--repeat-stop", type=int, default=REPEAT_STOP, help="end an output at its first repeated run of N tokens")
    add_dtype_option(p)
    p.add_argument("--judge", default=None, help="a local model (folder or name) or an OpenAI-compatible base URL")
    p.add_argument("--judge-model", default="judge", help="the model name sent to a judge URL")
    p.add_argument("--direct-asks-count", action="store_true",
                   help="the direct engine asks a counted question for its count, as a counted question whose "
                        "skeleton is no plan does (the prompt format's counted_direct)")
    p.add_argument("--json-only", action="store_true")
    args = p.parse_args(argv)
    out = Console(quiet=args.json_only, soft_wrap=True, width=200)
    questions, sources = [], []
    for path in args.questions or DEFAULT_FILES:
        qs, source = load_prompts(path, args.limit, args.per_category)
        questions += qs
        sources.append(source)
    judge = make_judge(args.judge, args.judge_model) if args.judge else None
    planned_config = SoTConfig(sot=args.sot, prompt_format=args.prompt_format)  # a bad format fails before the model loads

    from specsot_mq.loader import load_generator
    from specsot_mq.sot.engine import SoTEngine

    # No prefix store beyond the pinned prompt heads, and prompt lookup's History as of the question
    # for each answer: the second answer to a question must not start from the first one's prompt
    # or copy its words, and both engines draft from the same earlier outputs (both answers to
    # every earlier question), so that a question the router sends direct is decoded alike.
    gen = load_generator(args.model, args.dtype, "cpu", 2048, 8, args.draft, quantize=args.quantize, prefix_cache_mb=0)
    args.dtype = str(gen.model.dtype).removeprefix("torch.")
    planned_engine = SoTEngine(gen, planned_config)
    direct_engine = SoTEngine(gen, SoTConfig(sot="never"))
    planned_engine.keep_heads(), direct_engine.keep_heads()  # as a server answers: computed already
    params = SamplingParams(max_tokens=args.max_tokens, repeat_stop=args.repeat_stop)
    out.print(f"CPU {cpu_name()} | threads {torch.get_num_threads()} | {args.dtype} | {len(questions)} questions "
              f"({', '.join(sources)}) | max tokens {args.max_tokens} per phase | planned: --sot {args.sot}")  # fmt: skip
    earlier: list[list[int]] = []  # outputs of the questions answered so far, oldest first
    written: list[list[int]] = []  # this question's, from both answers

    counted_direct = planned_engine.format.counted_direct

    def answer(engine, question: str):
        if engine is direct_engine and args.direct_asks_count and (count := asked_count(question)):
            question = counted_direct.format(question=question, count=count)
        gen.history = Recorded(earlier, written)
        start = time.perf_counter()
        return engine.generate(question, params), time.perf_counter() - start

    answer(planned_engine, "Say hello.")  # warm-up (and the router, loaded or trained, for --sot auto)
    answer(direct_engine, "Say hello.")
    written.clear()

    rows = []
    for n, question in enumerate(questions):
        # Which goes first alternates, so neither always finds the machine's caches warmer.
        if n % 2:
            (direct, direct_s), (planned, planned_s) = answer(direct_engine, question), answer(planned_engine, question)
        else:
            (planned, planned_s), (direct, direct_s) = answer(planned_engine, question), answer(direct_engine, question)
        row = measure(question, planned, direct) | {"planned_s": planned_s, "direct_s": direct_s}
        earlier += written
        written.clear()
        while sum(map(len, earlier)) > History().max_tokens:  # what a History would still hold
            earlier.pop(0)
        if judge is not None:
            row["judge"] = judged(judge, question, planned.answer, direct.answer)
        rows.append(row)

    result = summarize(rows, out)
    result.update(questions=len(rows), sources=sources, cpu=cpu_name(), threads=torch.get_num_threads(),
                  dtype=args.dtype, max_tokens=args.max_tokens, sot=args.sot, prompt_format=planned_config.prompt_format,
                  judge=args.judge,
                  direct_asks_count=args.direct_asks_count, per_question=rows)  # fmt: skip
    print(json.dumps(result), flush=True)
    return result


class Recorded(History):
    """A History holding `earlier` outputs that also keeps what is added to it in `written`."""

    def __init__(self, earlier: list[list[int]], written: list[list[int]]):
        super().__init__()
        for tokens in earlier:
            super().add(tokens)
        self.written = written

    def add(self, tokens: list[int]) -> None:
        self.written.append(list(tokens))
        super().add(tokens)


def shown_points(answer) -> list[tuple[str, str]]:
    """(title, text) of each point the merged answer shows, in order, read off its text."""
    if answer.mode != "sot":
        return []
    dropped = set(answer.stats.get("dropped_points", []))
    titles = [title for index, title, _ in answer.points if index not in dropped]
    heads = [f"{n}. {title}:" for n, title in enumerate(titles, 1)]
    text, points = answer.answer, []
    for n, head in enumerate(heads):
        begin = text.find(head) + len(head)
        end = text.find("\n" + heads[n + 1], begin) if n + 1 < len(heads) else len(text)
        points.append((titles[n], text[begin:end]))
    return points


def distinct_items(answer: str, question: str) -> int:
    """A direct answer's numbered items that say something of their own, read as the parser reads
    a skeleton (an item repeating an earlier one, or restating the question, does not count)."""
    plan = parse_skeleton(answer, 2 * MOST_ASKED, question)
    return len(plan.points) if plan.kind == "plan" else min(len(item_starts(answer)), 1)


def measure(question: str, planned, direct) -> dict:
    """The structural figures of one question's two answers."""
    points = shown_points(planned)
    texts = [content_words(text) for _, text in points]
    pairs = [(a, b) for a in range(len(points)) for b in range(a + 1, len(points))]
    asked = asked_count(question)
    direct_words = content_words(direct.answer)
    items = len(points) if planned.mode == "sot" else distinct_items(planned.answer, question)
    reason = planned.reason
    again = planned.stats.get("written_again", [])
    return {
        "question": question, "mode": planned.mode, "points": len(points),
        # which way the planned engine went: a plan, the router's direct way, or a skeleton that said direct
        "route": "planned" if planned.mode == "sot" else "skeleton said direct" if reason.startswith("skeleton says direct")
        else "routed direct",
        "empty": sum(not re.search(r"\w", text) for _, text in points),
        "dup": sum(same_point(points[a][0], points[b][0]) for a, b in pairs),
        "restate": sum(restates(title, question) or says_nothing(text, question, title) for title, text in points),
        "dropped_parser": reason.count("which says what") + reason.count("which restates"),
        "dropped_merge": len(planned.stats.get("dropped_points", [])),
        # points a counted answer wrote again (it showed fewer than its count), and of them those shown
        "again": [len(again), len(set(again) - set(planned.stats.get("dropped_points", [])))],
        "overlap": max((jaccard(texts[a], texts[b]) for a, b in pairs), default=0.0),
        "distinct3": [distinct3(planned.answer), distinct3(direct.answer)],
        "coverage": len(direct_words & content_words(planned.answer)) / len(direct_words) if direct_words else 1.0,
        "asked": asked, "items": items, "count_ok": None if asked is None else items == asked,
        "count_ok_direct": None if asked is None else distinct_items(direct.answer, question) == asked,
        "tokens": [answer_tokens(planned), answer_tokens(direct)],
        "words": [len(planned.answer.split()), len(direct.answer.split())],
    }  # fmt: skip


def distinct3(text: str) -> float:
    """Distinct word 3-grams over all word 3-grams (1.0 for text too short to have one)."""
    words = re.findall(r"\w+", text.lower())
    grams = list(zip(words, words[1:], words[2:]))
    return len(set(grams)) / len(grams) if grams else 1.0


def summarize(rows: list[dict], out: Console) -> dict:
    table = Table(title="planned answer beside the direct answer (per question)")
    for col in ("question", "mode", "pts", "empty", "dup", "restate", "dropped", "overlap", "distinct3 p/d",
                "coverage", "count", "tokens p/d", "seconds p/d"):  # fmt: skip
        table.add_column(col, justify="left" if col == "question" else "right", max_width=28 if col == "question" else None,
                         no_wrap=col == "question", overflow="ellipsis")  # fmt: skip
    for r in rows:
        count = "-" if r["count_ok"] is None else f"{r['items']}/{r['asked']}"
        table.add_row(r["question"], r["mode"], str(r["points"]), str(r["empty"]), str(r["dup"]), str(r["restate"]),
                      f"{r['dropped_parser']}+{r['dropped_merge']}", f"{r['overlap']:.2f}",
                      f"{r['distinct3'][0]:.2f}/{r['distinct3'][1]:.2f}", f"{r['coverage']:.2f}", count,
                      f"{r['tokens'][0]}/{r['tokens'][1]}", f"{r['planned_s']:.1f}/{r['direct_s']:.1f}")  # fmt: skip
    out.print(table)
    planned = [r for r in rows if r["mode"] == "sot"]
    counted = [r for r in rows if r["count_ok"] is not None]
    med = lambda key, i=None: round(statistics.median(r[key] if i is None else r[key][i] for r in rows), 3) if rows else None  # noqa: E731
    result = {
        "planned_answers": len(planned), "points": sum(r["points"] for r in planned),
        "empty_points": sum(r["empty"] for r in planned), "duplicate_titles": sum(r["dup"] for r in planned),
        "restating_points": sum(r["restate"] for r in planned),
        "dropped_by_parser": sum(r["dropped_parser"] for r in planned),
        "dropped_by_merge": sum(r["dropped_merge"] for r in planned),
        "written_again_shown": [sum(r["again"][0] for r in planned), sum(r["again"][1] for r in planned)],
        "overlap_median": round(statistics.median(r["overlap"] for r in planned), 3) if planned else None,
        "overlap_max": round(max((r["overlap"] for r in planned), default=0.0), 3),
        "distinct3_median": [med("distinct3", 0), med("distinct3", 1)],
        "coverage_median": med("coverage"),
        # every counted question's answer (planned or gone direct); the same questions' direct answers
        "count_following": f"{sum(r['count_ok'] for r in counted)}/{len(counted)}",
        "count_following_planned_only": f"{sum(r['count_ok'] for r in counted if r['mode'] == 'sot')}/"
                                        f"{sum(r['mode'] == 'sot' for r in counted)}",
        "count_following_direct": f"{sum(r['count_ok_direct'] for r in counted)}/{len(counted)}",
        "tokens_median": [med("tokens", 0), med("tokens", 1)], "words_median": [med("words", 0), med("words", 1)],
        "seconds_median": [med("planned_s"), med("direct_s")],
        "direct_over_planned_seconds_median": round(statistics.median(r["direct_s"] / r["planned_s"] for r in rows), 3)
        if rows else None,
        # the same median over the questions of each route, and how many took it
        "by_route": {route: [sum(r["route"] == route for r in rows),
                             round(statistics.median(r["direct_s"] / r["planned_s"] for r in rows if r["route"] == route), 3)]
                     for route in ("planned", "routed direct", "skeleton said direct") if any(r["route"] == route for r in rows)},
    }  # fmt: skip
    verdicts = [r["judge"] for r in rows if "judge" in r]
    if verdicts:
        result["judge"] = {v: verdicts.count(v) for v in ("planned", "tie", "direct", "error")}
    summary = Table(title="summary (planned / direct where two)")
    summary.add_column("figure")
    summary.add_column("value", justify="right")
    for key, value in result.items():
        summary.add_row(key, str(value))
    out.print(summary)
    return result


def make_judge(where: str, model_name: str):
    """messages -> the judge's reply: an OpenAI-compatible URL, or a local model run greedily here."""
    if where.startswith(("http://", "https://")):
        url = where.rstrip("/") + "/chat/completions"

        def ask(messages: list[dict]) -> str:
            body = json.dumps({"model": model_name, "messages": messages, "temperature": 0, "max_tokens": 512}).encode()
            request = urllib.request.Request(url, body, {"Content-Type": "application/json"})
            try:
                with urllib.request.urlopen(request, timeout=300) as response:
                    return json.loads(response.read())["choices"][0]["message"]["content"]
            except (OSError, ValueError, KeyError) as exc:
                raise SpecSotError(f"the judge at {url} did not answer ({exc}): check --judge") from None

        return ask
    from specsot_mq.loader import load_generator

    judge_gen = load_generator(where, num_slots=1, max_len=4096, draft="none")
    return lambda messages: judge_gen.generate(messages, SamplingParams(max_tokens=512)).text


def judged(ask, question: str, planned: str, direct: str) -> str:
    """"planned", "direct" or "tie": the judge in both orders; a verdict that follows the order
    (or none found) is a tie, as FastChat counts it."""
    def verdict(a: str, b: str) -> str | None:
        reply = ask([{"role": "system", "content": JUDGE_SYSTEM},
                     {"role": "user", "content": JUDGE_USER.format(question=question, answer_a=a, answer_b=b)}])  # fmt: skip
        found = VERDICT.findall(reply)
        return found[-1] if found else None

    first, second = verdict(planned, direct), verdict(direct, planned)
    if first is None and second is None:
        return "error"
    if first == "A" and second == "B":
        return "planned"
    if first == "B" and second == "A":
        return "direct"
    return "tie"


if __name__ == "__main__":
    run_script(main)
