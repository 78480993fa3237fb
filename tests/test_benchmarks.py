"""The benchmarks' input reading (benchmarks/decode.py, router.py): what their commands take; and
router.py's ceiling on a labelled file."""

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
from decode import load_prompts  # noqa: E402
from router import own_labels, read_labelled  # noqa: E402

from specsot_mq.errors import SpecSotError  # noqa: E402


def write(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def test_per_category_caps_only_lines_that_have_a_category(tmp_path):
    """peer.py takes 2 a category by default (MT-bench's first 10 are all writing). A file whose
    lines name no category, as the project's question files, is not capped: `--limit 24` takes
    24 (it had taken 2, all of them one category None)."""
    plain = write(tmp_path / "q.jsonl", [{"question": f"Question {i}?"} for i in range(30)])
    assert load_prompts(plain, 24, per_category=2)[0] == [f"Question {i}?" for i in range(24)]
    bench = write(tmp_path / "mt.jsonl", [{"turns": [f"T{i}"], "category": "writing" if i < 10 else "math"}
                                          for i in range(20)])  # fmt: skip
    assert load_prompts(bench, 24, per_category=2)[0] == ["T0", "T1", "T10", "T11"]
    assert len(load_prompts(bench, 24, per_category=0)[0]) == 20
    labelled = write(tmp_path / "l.jsonl", [{"question": f"Q{i}", "label": "plan" if i % 2 else "direct"} for i in range(9)])
    assert load_prompts(labelled, 3, per_category=2, label="plan")[0] == ["Q1", "Q3", "Q5"]


def test_a_line_that_is_no_question_is_named(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "Fine?"}\n{"prompt": "no"}\n')
    with pytest.raises(SpecSotError, match="bad.jsonl:2 is not a question"):
        load_prompts(bad, 10)


def test_labels_read_in_ours_and_in_sot_r_form(tmp_path):
    """router.py --heldout takes our JSONL or SoT-R's published router.csv (`label;request`, 1 =
    plan; a request may hold the separator and newlines inside quotes)."""
    ours = write(tmp_path / "ours.jsonl", [{"question": "Q?", "label": "plan", "kind": "advice"}])
    assert read_labelled(ours) == [{"question": "Q?", "label": "plan", "kind": "advice"}]
    folder = tmp_path / "vicuna"
    folder.mkdir()
    theirs = folder / "router.csv"
    theirs.write_text('label;request\n1;How can I sleep better?\n0;"Solve; then\nexplain: 2+2"\n', encoding="utf-8")
    assert read_labelled(theirs) == [
        {"question": "How can I sleep better?", "label": "plan", "kind": "vicuna"},
        {"question": "Solve; then\nexplain: 2+2", "label": "direct", "kind": "vicuna"},
    ]
    bad = tmp_path / "bad.csv"
    bad.write_text("question,label\nQ?,plan\n")
    with pytest.raises(SpecSotError, match="needs the header `label;request`"):
        read_labelled(bad)


def test_own_labels_follows_labels_the_features_carry_and_not_labels_they_do_not():
    """router.py's ceiling on a labelled file: the classifier fit on the file's own labels, cross-
    validated. Labels set by one feature are followed; labels drawn apart from the features are not."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(200, 16, generator=gen)
    carried = own_labels(x, (x[:, 3] > 0).tolist())
    assert carried["accuracy"] >= 0.9 and len(carried["each"]) == carried["shuffles"] == 3
    noise = own_labels(x, (torch.rand(200, generator=gen) > 0.5).tolist())
    assert noise["accuracy"] < 0.7
