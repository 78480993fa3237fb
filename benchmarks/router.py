"""The router's accuracy and cost on the labelled validation split, beside the alternatives.

  learned   the learned router (sot/learned_router.py), trained here from nothing (--cached: the
            one cached for the model) on specsot_mq/sot/labels/train.jsonl
  rules     the hand-written pattern table (router.rule_route), the learned router's fallback
  prompt    a prompt to the model: the `plan` format's skeleton prompt, read as PLAN against
            DIRECT after its prefilled "[" (the logit margin, threshold 0, and the threshold best
            on the train split), one forward of the skeleton prompt

Each is scored on specsot_mq/sot/labels/valid.jsonl (never trained or tuned on), per kind of
question too, and timed per question (median; one forward each for learned and prompt). Also
the learned router's accuracy on MT-bench's and the general questions when trained without them
(the written questions alone): how it carries to questions written by others. Prints tables and
one JSON line. Last, both on --heldout (default benchmarks/router_heldout.jsonl: 200 labelled
questions written apart from the shipped labels, in the style of WizardLM's and Vicuna's test
sets, never trained on); --heldout also reads SoT-R's own labels (data/vicuna/router.csv and
data/wizardlm/router.csv in github.com/imagination-research/sot, `label;request`). Beside each
held-out file, the same classifier fit on that file's own labels, 5-fold cross-validated: how far
the model's representation can follow those labels at all, whatever labels it learns from.

    python benchmarks/router.py [--model NAME] [--cached] [--no-prompt] [--heldout FILE] [--json-only]
"""

from __future__ import annotations

import argparse
import csv
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode import cpu_name, run_script  # noqa: E402  (a sibling script)

from specsot_mq.errors import SpecSotError  # noqa: E402
from specsot_mq.model import Step  # noqa: E402
from specsot_mq.sot.learned_router import LearnedRouter, fit, forward, load_labels  # noqa: E402
from specsot_mq.sot.router import rule_route  # noqa: E402


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None)
    p.add_argument("--cached", action="store_true", help="the router cached for the model (train it if none)")
    p.add_argument("--no-prompt", action="store_true", help="skip the prompt alternative (160 longer forwards)")
    p.add_argument("--heldout", type=Path, default=Path(__file__).parent / "router_heldout.jsonl",
                   help="labelled questions never trained on: JSONL (question, label, kind), or SoT-R's router.csv")
    p.add_argument("--json-only", action="store_true")
    args = p.parse_args(argv)
    out = Console(quiet=args.json_only, soft_wrap=True)

    from specsot_mq.loader import load_generator

    gen = load_generator(args.model, num_slots=1, max_len=1024, draft="none")
    model, tok = gen.model, gen.tokenizer
    train, valid = load_labels("train"), load_labels("valid")
    truth = [r["label"] == "plan" for r in valid]
    forward(model, tok.encode("Warm up.", add_special_tokens=False), (), logits=False)

    start = time.perf_counter()
    router = (LearnedRouter.for_model(model, tok) if args.cached
              else LearnedRouter.for_model(model, tok, Path(tempfile.mkdtemp(prefix="specsot-router-"))))  # fmt: skip
    build_s = time.perf_counter() - start
    ways = {"learned": timed(lambda q: router.p_plan(q) >= 0.5, valid), "rules": timed(lambda q: rule_route(q).use_sot, valid)}
    if not args.no_prompt:
        ways.update(prompt_router(model, tok, train, valid))

    table = Table(title=f"routing the {len(valid)} validation questions")
    for col in ("router", "accuracy", "planned wrongly", "direct wrongly", "ms per question"):
        table.add_column(col, justify="left" if col == "router" else "right")
    result = {"cpu": cpu_name(), "threads": torch.get_num_threads(), "model": args.model or "default",
              "train": len(train), "valid": len(valid), "learned_info": router.info,
              "learned_build_seconds": round(build_s, 2)}  # fmt: skip
    for name, (got, ms) in ways.items():
        right = sum(g == t for g, t in zip(got, truth))
        over = sum(g and not t for g, t in zip(got, truth))
        under = sum(t and not g for g, t in zip(got, truth))
        result[name] = {"accuracy": round(right / len(valid), 4), "planned_wrongly": over, "direct_wrongly": under,
                        "ms_per_question": round(ms, 2)}  # fmt: skip
        table.add_row(name, f"{right / len(valid):.3f}", str(over), str(under), f"{ms:.2f}")
    out.print(table)

    kinds = Table(title="learned router, validation accuracy by kind of question")
    for col in ("kind", "label", "questions", "right"):
        kinds.add_column(col)
    got = ways["learned"][0]
    by_kind = {}
    for r, g, t in zip(valid, got, truth):
        k = by_kind.setdefault(r["kind"], [r["label"], 0, 0])
        k[1] += 1
        k[2] += g == t
    for kind, (label, n, right) in sorted(by_kind.items()):
        kinds.add_row(kind, label, str(n), str(right))
    out.print(kinds)
    result["learned_by_kind"] = {k: {"label": v[0], "questions": v[1], "right": v[2]} for k, v in by_kind.items()}
    result["learned_written_only"] = carried(router, train + valid, out)
    if args.heldout.exists():
        result["heldout"] = heldout(router, args.heldout, out)
    print(json.dumps(result), flush=True)
    return result


def timed(decide, rows) -> tuple[list[bool], float]:
    """Each question's decision, and the median milliseconds per decision."""
    got, times = [], []
    for r in rows:
        start = time.perf_counter()
        got.append(bool(decide(r["question"])))
        times.append((time.perf_counter() - start) * 1000)
    return got, statistics.median(times)


def prompt_router(model, tok, train, valid) -> dict:
    """The `plan` format's own decision: PLAN against DIRECT after the skeleton prompt's "["."""
    from specsot_mq.prompts import load_format

    fmt = load_format("plan")
    plan_id, direct_id = (tok.encode(w, add_special_tokens=False)[0] for w in ("PLAN", "DIRECT"))

    def margin(question: str) -> float:
        ids = fmt.skeleton_ids(tok, question)
        step = Step.fresh(torch.arange(len(ids)).unsqueeze(0), logit_rows=[len(ids) - 1])  # the last row's alone
        with torch.inference_mode():
            logits = model(torch.tensor([ids]), model.new_cache(1, len(ids)), step).logits[0]
        return (logits[plan_id] - logits[direct_id]).item()

    on_train = [margin(r["question"]) for r in train]
    labels = [r["label"] == "plan" for r in train]
    best = max(sorted(on_train), key=lambda th: sum((m >= th) == y for m, y in zip(on_train, labels)))
    margins, times = [], []
    for r in valid:
        start = time.perf_counter()
        margins.append(margin(r["question"]))
        times.append((time.perf_counter() - start) * 1000)
    ms = statistics.median(times)
    return {"prompt (threshold 0)": ([m > 0 for m in margins], ms),
            f"prompt (threshold {best:.2f}, fit on train)": ([m >= best for m in margins], ms)}  # fmt: skip


def heldout(router: LearnedRouter, path: Path, out: Console) -> dict:
    """The learned router and the rules on a labelled file no router trains on (the default:
    benchmarks/router_heldout.jsonl, 200 questions written apart from the shipped labels, in the
    style of WizardLM's and Vicuna's test sets), with its misses by kind."""
    rows = read_labelled(path)
    truth = [r["label"] == "plan" for r in rows]
    x = router.features([r["question"] for r in rows])
    learned = [router.p_plan_of(feature) >= 0.5 for feature in x]
    result = {"file": path.name, "questions": len(rows)}
    for name, got in (("learned", learned), ("rules", [rule_route(r["question"]).use_sot for r in rows])):
        misses: dict[str, int] = {}
        for r, g, t in zip(rows, got, truth):
            if g != t:
                misses[r["kind"]] = misses.get(r["kind"], 0) + 1
        right = sum(g == t for g, t in zip(got, truth))
        result[name] = {"accuracy": round(right / len(rows), 4), "planned_wrongly": sum(g and not t for g, t in zip(got, truth)),
                        "direct_wrongly": sum(t and not g for g, t in zip(got, truth)), "misses_by_kind": misses}  # fmt: skip
        out.print(f"{name} on {path.name}: {right}/{len(rows)} right ({right / len(rows):.3f}), misses by kind {misses}")
    result["own_labels"] = own_labels(x, truth)
    own = result["own_labels"]
    out.print(f"the same classifier trained on {path.name}'s own labels, {own['folds']}-fold over {own['shuffles']} shuffles: "
              f"{own['accuracy']:.3f} (from {min(own['each']):.3f} to {max(own['each']):.3f}): how far the model's "
              "representation follows these labels at all (nothing of it is kept)")  # fmt: skip
    return result


def own_labels(x: torch.Tensor, truth: list[bool], folds: int = 5, shuffles: int = 3) -> dict:
    """Cross-validated accuracy of the router's classifier fit on a labelled file's own labels
    (each fold scored by a fit on the others; the router's features and fit): a ceiling on what
    the features can reach on those labels, which says whether a miss is the labels' or the
    training questions'."""
    y = torch.tensor(truth, dtype=torch.float32)
    each = []
    for seed in range(shuffles):
        order = torch.randperm(len(truth), generator=torch.Generator().manual_seed(seed))
        right = 0
        for k in range(folds):
            test = order[k::folds]
            train = order[torch.isin(order, test, invert=True)]
            w = fit(x[train], y[train])
            got = ((x[test] - w["mean"]) / w["std"] @ w["weight"] + w["bias"]) > 0
            right += (got == y[test].bool()).sum().item()
        each.append(round(right / len(truth), 4))
    return {"folds": folds, "shuffles": shuffles, "accuracy": round(statistics.mean(each), 4), "each": each}


def read_labelled(path: Path) -> list[dict]:
    """Labelled questions: our JSONL (question, label plan|direct, kind), or a CSV in SoT-R's
    published form (data/<set>/router.csv in imagination-research/sot: `label;request`, 1 where
    the answer suits a plan), whose rows all get the file's name as their kind."""
    if path.suffix != ".csv":
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    with path.open(newline="", encoding="utf-8") as f:
        reader = csv.DictReader(f, delimiter=";")
        if reader.fieldnames != ["label", "request"]:
            raise SpecSotError(f"{path}: a CSV of labels needs the header `label;request` (SoT-R's form), "
                               f"not {reader.fieldnames}")  # fmt: skip
        return [{"question": r["request"], "label": "plan" if r["label"].strip() == "1" else "direct", "kind": path.parent.name or path.stem}
                for r in reader]  # fmt: skip


def carried(router: LearnedRouter, rows: list[dict], out: Console) -> dict:
    """Trained on the written questions alone (of both splits), scored on MT-bench's and the
    general questions: how the recipe carries to questions written by others."""
    written = [r for r in rows if r["source"] == "written"]
    others = [r for r in rows if r["source"] != "written"]
    x = router.features([r["question"] for r in written])
    weights = fit(x, torch.tensor([r["label"] == "plan" for r in written], dtype=torch.float32))
    z = (router.features([r["question"] for r in others]) - weights["mean"]) / weights["std"]
    got = (z @ weights["weight"] + weights["bias"] > 0).tolist()
    right = sum(g == (r["label"] == "plan") for g, r in zip(got, others))
    out.print(f"trained on the {len(written)} written questions alone: {right}/{len(others)} right on MT-bench's "
              f"and the general questions ({right / len(others):.3f})")  # fmt: skip
    return {"trained_on": len(written), "scored_on": len(others), "accuracy": round(right / len(others), 4)}


if __name__ == "__main__":
    run_script(main)
