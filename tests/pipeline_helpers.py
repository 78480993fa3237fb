"""Shared by the pipeline tests: a tiny random model folder (with the real tokenizer) and a random
draft head for it, so stage processes load in a second; a fixed-plan parser stage (a tiny random
model writes no usable skeleton); and a launch that is always stopped."""

from __future__ import annotations

import shutil
from contextlib import contextmanager
from pathlib import Path

import torch

from specsot_mq.devices import REMOTE
from specsot_mq.sot.parser import Plan, Point
from specsot_mq.stages.parse import ParseStage

PLAN = Plan("plan", [Point(1, "Warm up"), Point(2, "Pick shoes", 80), Point(3, "Start slowly"),
                     Point(4, "Track progress", 20), Point(5, "Rest well")])  # fmt: skip


class FixedPlanParse(ParseStage):
    """Every skeleton gives PLAN (swapped in with --stage parse=tests.pipeline_helpers:FixedPlanParse)."""

    def plan(self, skeleton: str) -> Plan:
        return PLAN


def make_tiny_model(folder: Path, default_model_dir: Path) -> tuple[Path, Path]:
    """A tiny random Llama over the real tokenizer, saved as an HF folder, and a random draft head."""
    from conftest import ours_from_hf, tiny_hf
    from specsot_mq.draft import DraftConfig, DraftHead
    from specsot_mq.tokenizer import load_tokenizer

    tok = load_tokenizer(default_model_dir)
    hf = tiny_hf("llama", vocab_size=len(tok), max_position_embeddings=1024)
    hf.save_pretrained(folder, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        if (default_model_dir / name).exists():
            shutil.copy(default_model_dir / name, folder / name)
    base = ours_from_hf(hf)
    torch.manual_seed(1)
    head = DraftHead(DraftConfig.for_base(base.cfg, 512))
    head.d2t.copy_(torch.randperm(base.cfg.vocab_size)[:512])
    draft = folder / "draft.safetensors"
    head.save(draft)
    return folder, draft


@contextmanager
def launched(spec, run_dir, remote: str = REMOTE):
    """Start a topology, wait until every stage is ready, and stop it whatever happens."""
    import asyncio
    import os

    from specsot_mq.stages.launch import Launcher, wait_ready

    tests = str(Path(__file__).parent)  # stage processes import FixedPlanParse from here
    if tests not in os.environ.get("PYTHONPATH", "").split(os.pathsep):
        os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [tests, os.environ.get("PYTHONPATH")]))
    launcher = Launcher(spec, run_dir, remote=remote)
    launcher.start()
    passed = False
    try:
        asyncio.run(wait_ready(launcher, timeout=120))
        yield launcher
        passed = True
    finally:
        launcher.stop()  # keeps the logs where a stage died (a failed test's stay for a look)...
        if passed:  # ...but a test that passed leaves nothing behind, even where it killed a stage
            shutil.rmtree(run_dir, ignore_errors=True)
