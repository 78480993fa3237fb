"""How often draft heads guess right, by depth, on the base's own answers to questions no head was
trained on: teacher-forced, as training scores its held-out rows, but on benchmark questions
(general_questions.jsonl and router_heldout.jsonl by default), heads side by side in one run.

    python benchmarks/draft_accuracy.py [--draft HEAD.safetensors ...] [--questions FILE ...] [--new-tokens 128]

The base answers every question greedily once (no head involved); each head then reads the same
base features and guesses each next token as a chain would (depth 1 from the base's feature,
deeper from its own predictions), over every generated token: thousands of guesses, so heads that
differ by a point or two are told apart where `eagle.py`'s few in-engine answers are not (that
measures speed; this, the head alone). Groups: each file, and router_heldout's labels. The last
stdout line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode import cpu_name  # noqa: E402  (a sibling script)

from specsot_mq.draft import DraftHead  # noqa: E402
from specsot_mq.generate import Generator, Job  # noqa: E402
from specsot_mq.loader import load_model  # noqa: E402
from specsot_mq.pull import resolve_model  # noqa: E402
from specsot_mq.sampling import SamplingParams  # noqa: E402
from specsot_mq.tokenizer import chat_prompt_ids, load_tokenizer  # noqa: E402
from specsot_mq.train_draft import _decode, _float_view, capture_features, evaluate_head, target_to_draft  # noqa: E402

HERE = Path(__file__).resolve().parent
SHIPPED = HERE.parent / "specsot_mq" / "drafts" / "smollm2-135m-instruct.safetensors"


def groups_of(paths: list[Path], limit: int = 0) -> list[tuple[str, str]]:
    """(group, question) for the first `limit` lines (0: all) of each file: the group is the
    file's name, with the line's label where it has one."""
    out = []
    for path in paths:
        for line in path.read_text().splitlines()[: limit or None]:
            q = json.loads(line)
            out.append((path.stem + (f" ({q['label']})" if q.get("label") else ""), q["question"]))
    return out


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None)
    p.add_argument("--draft", nargs="+", default=[str(SHIPPED)], help="heads (.safetensors)")
    p.add_argument("--questions", nargs="+", type=Path,
                   default=[HERE / "general_questions.jsonl", HERE / "router_heldout.jsonl"])  # fmt: skip
    p.add_argument("--limit", type=int, default=0, help="first N questions of each file (0: all)")
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--depths", type=int, default=4)
    args = p.parse_args(argv)
    console = Console(stderr=True)
    folder = resolve_model(args.model)
    base, tok = load_model(folder), load_tokenizer(folder)
    asked = groups_of(args.questions, args.limit)
    heads = [DraftHead.load(h, base) for h in args.draft]
    layers = heads[0].cfg.feature_layers
    if any(h.cfg.feature_layers != layers for h in heads):
        sys.exit("the heads read different base features: compare heads of one --feature-layers at a time")
    gen = Generator(base, tok, max_len=1024, num_slots=32)
    prompts = [chat_prompt_ids(tok, q) for _, q in asked]
    answers = _decode(gen, [Job(i, ids, SamplingParams(max_tokens=args.new_tokens)) for i, ids in enumerate(prompts)])
    rows = [{"prompt": ids, "output": answers[i]} for i, ids in enumerate(prompts)]
    samples = capture_features(base, rows, layers, context=64)
    names = list(dict.fromkeys(g for g, _ in asked))
    result = {"device": cpu_name(), "new_tokens": args.new_tokens, "heads": {}}
    table = Table(title=f"teacher-forced top-1 by depth | {cpu_name()} | {len(asked)} answers x up to {args.new_tokens} tokens")
    table.add_column("head")
    for g in names:
        table.add_column(f"{g} ({sum(1 for a, _ in asked if a == g)})", justify="right")
    float_base = _float_view(base)
    for path, head in zip(args.draft, heads):
        head = head.float().attach(float_base)
        t2d = target_to_draft(head.d2t, base.cfg.vocab_size)
        by_group = {}
        for g in names:
            mine = [s for s, (a, _) in zip(samples, asked) if a == g]
            acc = evaluate_head(head, mine, t2d, args.depths, tokens_per_batch=4096)
            by_group[g] = [acc[f"heldout_acc_depth{d + 1}"] for d in range(args.depths)]
        result["heads"][path] = by_group
        table.add_row(Path(path).name, *[" / ".join(f"{a:.3f}" for a in by_group[g]) for g in names])
    console.print(table)
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
