"""The learned router: plan or direct, read off the base model's own representation of the question.

Features: one forward of the question's direct-answer chat prompt, truncated to
MAX_QUESTION_TOKENS of question, through the first half of the base model's layers (the forward
stops there: half a prefill's cost), over the prompt's fixed beginning (system prompt, turn marks:
the same for every question) computed once; at the layer half way up, the last token's hidden
state beside the mean over the tokens after that beginning (the question and the template's end). A logistic regression
(standardised features, L2) over them is trained on sot/labels/train.jsonl, full-batch L-BFGS,
in seconds; its accuracy on sot/labels/valid.jsonl is measured then and kept with it. The
in-process engine keeps the forward (`route(question, resume=...)`: the lower layers' keys and
values, the hidden state half way up): a direct answer's prefill goes on from it (sequence.Resume).

The trained router is cached under $SPECSOT_HOME/routers/, one file per (model, labels, feature
recipe): the model is known by its config, its activation dtype, its weights' kinds and its greedy
predictions on a fixed probe text, so a new model, or the same one quantized differently, trains
its own on first use. A model whose representation does not separate the labels (validation
accuracy under MIN_ACCURACY) routes by router.rule_route instead.

Chosen over the alternatives on SmolLM2-135M (docs/design.md has the figures): the pooling (last
token and mean together beat either alone and the mean over the bare question, in 5-fold
cross-validation on the train split); the layer: layers from about half to four fifths of the
way up classified the validation split equally well in a probe (the first and the last did
worse), and the lowest of that band costs least, so half way up.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from collections.abc import Iterable
from pathlib import Path

import torch
import torch.nn.functional as F

from specsot_mq.model import LlamaModel, Step
from specsot_mq.prompts import direct_ids, fixed_beginning
from specsot_mq.sequence import Resume
from specsot_mq.sot.router import Route, rule_route, short_answer

LABELS = Path(__file__).parent / "labels"
RECIPE = "chat-last+mean@0.5/logreg-l2-0.01/v3"  # changes to the features or the fit change this
MAX_QUESTION_TOKENS = 256
MIN_ACCURACY = 0.9
L2 = 0.01
PROBE = ("The quick brown fox jumps over the lazy dog. Water boils at 100 degrees Celsius at sea level, "
         "and the capital of France is Paris. def add(a, b): return a + b")  # fmt: skip


def load_labels(split: str) -> list[dict]:
    """The labelled questions of one split ("train" or "valid"): {"question", "label" ("plan" or
    "direct"), "kind", "source"} each."""
    return [json.loads(line) for line in (LABELS / f"{split}.jsonl").read_text().splitlines() if line.strip()]


class LearnedRouter:
    """question -> Route over one model; build it with `for_model` (cached) or `train`."""

    def __init__(self, model, tokenizer, weights: dict[str, torch.Tensor], info: dict):
        self.model, self.tokenizer = model, tokenizer
        self.weights, self.info = weights, info  # mean, std, weight, bias; what training measured
        self.layer = layer_for(model)
        self.head = fixed_beginning(lambda q: direct_ids(tokenizer, q))  # every prompt's first tokens
        self.head_kv = None  # their keys and values, computed on first use
        # the cache every routed question's forward runs in (kept: a new one per question paid for
        # its memory's first touch each time); a route's Resume reads it until the next route
        self.cache = None

    @classmethod
    def for_model(cls, model, tokenizer, home: Path | None = None) -> LearnedRouter:
        """The router cached for this model and the shipped labels, trained (and cached) on first use."""
        path = cache_path(model, home)
        if path.exists():
            from safetensors import safe_open

            with safe_open(str(path), "pt") as f:
                weights = {k: f.get_tensor(k) for k in f.keys()}
                info = json.loads(f.metadata()["info"])
            return cls(model, tokenizer, weights, info)
        print(f"specsot: training the --sot auto router for this model, once (cached in {path.parent})",
              file=sys.stderr, flush=True)  # fmt: skip
        router = cls.train(model, tokenizer, progress=True)
        router.save(path)
        return router

    @classmethod
    def train(cls, model, tokenizer, progress: bool = False) -> LearnedRouter:
        """Fit on the train split and measure on the validation split (`progress`: a bar on stderr
        for each, gone when done: a few seconds for the default model, minutes at real sizes)."""
        from rich.console import Console
        from rich.progress import track

        def bar(rows: list[dict], what: str):
            return track(rows, what, console=Console(stderr=True), transient=True, disable=not progress)

        start = time.perf_counter()
        router = cls(model, tokenizer, {}, {})
        train, valid = load_labels("train"), load_labels("valid")
        x = router.features(r["question"] for r in bar(train, "router: reading the labelled questions"))
        y = torch.tensor([r["label"] == "plan" for r in train], dtype=torch.float32)
        router.weights = fit(x, y)
        seconds = time.perf_counter() - start
        t = time.perf_counter()
        got = [router.p_plan(r["question"]) >= 0.5 for r in bar(valid, "router: validating")]
        ms = (time.perf_counter() - t) / len(valid) * 1000
        right = sum(g == (r["label"] == "plan") for g, r in zip(got, valid))
        router.info = {"recipe": RECIPE, "layer": router.layer, "train": len(train), "valid": len(valid),
                       "valid_accuracy": round(right / len(valid), 4), "train_seconds": round(seconds, 2),
                       "ms_per_question": round(ms, 2)}  # fmt: skip
        return router

    def save(self, path: Path) -> None:
        from safetensors.torch import save_file

        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        save_file({k: v.contiguous() for k, v in self.weights.items()}, str(tmp), metadata={"info": json.dumps(self.info)})
        tmp.replace(path)  # atomic: another process may read it at once

    @property
    def usable(self) -> bool:
        """Whether the classifier separates the labels on this model (else rule_route decides)."""
        return self.info.get("valid_accuracy", 0.0) >= MIN_ACCURACY

    def features(self, questions: Iterable[str]) -> torch.Tensor:
        """[N, 2 * hidden]: each question's last-token and mean hidden state at self.layer."""
        return torch.stack([self._forward(q)[0] for q in questions])

    def p_plan(self, question: str) -> float:
        """The classifier's probability that the question is answered better with a plan."""
        return self.p_plan_of(self._forward(question)[0])

    def __call__(self, question: str) -> Route:
        return self.route(question)[0]

    def route(self, question: str, resume: tuple[int, ...] | None = None) -> tuple[Route, Resume | None]:
        """The question's way, and with `resume` (the hidden states a draft head reads, () for
        none) its direct prompt's forward as far as the router ran it (sequence.Resume: a direct
        answer's prefill goes on from there), where it ran it."""
        if not self.usable:
            route = rule_route(question)
            return Route(route.use_sot, f"{route.reason} (the learned router is not used on this model: validation "
                                        f"accuracy {self.info.get('valid_accuracy')})"), None  # fmt: skip
        feature, ran = self._forward(question, resume)
        p = self.p_plan_of(feature)
        if p < 0.5:
            return Route(False, f"the router says direct (plan {p:.2f})"), ran
        if why := short_answer(question):
            return Route(False, why), ran
        return Route(True, f"the router says plan (plan {p:.2f})"), ran

    def p_plan_of(self, feature: torch.Tensor) -> float:
        """p_plan from a question's feature (a row of `features`)."""
        w = self.weights
        return torch.sigmoid((feature - w["mean"]) / w["std"] @ w["weight"] + w["bias"]).item()

    def _forward(self, question: str, resume: tuple[int, ...] | None = None) -> tuple[torch.Tensor, Resume | None]:
        """The question's feature, and with `resume` the forward it came from, keeping the hidden
        states named there that it computes (a question cut to MAX_QUESTION_TOKENS, or a split
        model, gives none: its direct answer's prompt is not the one run, or runs elsewhere)."""
        tok, model = self.tokenizer, self.model
        # (tokens of a text number its bytes at most, and a tokenizer's leading space: a question
        # of fewer bytes than that is not counted)
        long = len(question.encode()) >= MAX_QUESTION_TOKENS
        ids = tok.encode(question, add_special_tokens=False) if long else []
        whole = len(ids) <= MAX_QUESTION_TOKENS
        if not whole:
            question = tok.decode(ids[:MAX_QUESTION_TOKENS])
        ids = direct_ids(tok, question)
        if self.head_kv is None:
            self.head_kv = _kv(forward(model, self.head, (self.layer,), logits=False)[2])
        held = len(self.head) if ids[: len(self.head)] == self.head and len(ids) > len(self.head) else 0
        earlier = tuple(n for n in resume or () if n < self.layer)
        if self.cache is None or self.cache.capacity < len(ids):  # sized once for any question (cut to
            # MAX_QUESTION_TOKENS; the template's end is a few tokens more)
            self.cache = model.new_cache(1, max(len(ids), len(self.head) + MAX_QUESTION_TOKENS + 64), graphs=False)
        (hidden, *kept), _, cache = forward(model, ids, (self.layer, *earlier), logits=False,
                                            held=self.head_kv if held else None, cache=self.cache)  # fmt: skip
        ran = None
        if resume is not None and whole and held and isinstance(model, LlamaModel):
            kv = (cache.k[: self.layer, 0, :, held : len(ids)], cache.v[: self.layer, 0, :, held : len(ids)])
            ran = Resume(ids, self.layer, held, kv, hidden[0], {n: h[0] for n, h in zip(earlier, kept)})
        hidden = hidden[0].float()  # [T - held, H]: the tokens after the fixed beginning
        return torch.cat([hidden[-1], hidden.mean(0)]), ran


def layer_for(model) -> int:
    """The hidden state the features read: half way up the layers (the forward stops there)."""
    return model.cfg.num_layers // 2


def forward(model, ids: list[int], layers: tuple[int, ...], logits: bool, held=None, cache=None):
    """One forward of a prompt over a cache of its own (the generator's slots stay untouched; a
    new one, or `cache`, slot 0 overwritten), where `held` (keys and values of its first tokens,
    _kv) spares computing those again; without
    logits it runs only the layers up to the last hidden state asked for (model.Step):
    ([the hidden states asked for, [1, T, H] each, of the tokens computed], the logits [1, T, V]
    or None, the cache)."""
    if cache is None:
        cache = model.new_cache(1, len(ids), graphs=False)  # (a forward that stops early is never captured)
    start = cache.restore(0, held) if held is not None else 0
    positions = torch.arange(start, len(ids), device=model.device).unsqueeze(0)
    step = Step([0], [start], positions, logit_rows=None if logits else [], hidden_layers=layers)
    with torch.inference_mode():
        out = model(torch.tensor([ids[start:]], device=model.device), cache, step)
    return [h.cpu() for h in out.hidden], (out.logits.cpu() if logits else None), cache


def _kv(cache) -> tuple[torch.Tensor, torch.Tensor]:
    """The keys and values a cache of one prompt holds (a split model's too: split.py)."""
    return cache.snapshot(0, cache.capacity)


def fit(x: torch.Tensor, y: torch.Tensor, l2: float = L2) -> dict[str, torch.Tensor]:
    """Logistic regression on standardised features: mean, std, weight, bias (float32)."""
    mean, std = x.mean(0), x.std(0) + 1e-6
    z = (x - mean) / std
    with torch.enable_grad():
        w = torch.zeros(z.shape[1], requires_grad=True)
        b = torch.zeros(1, requires_grad=True)
        opt = torch.optim.LBFGS([w, b], max_iter=200, line_search_fn="strong_wolfe")

        def loss():
            opt.zero_grad()
            value = F.binary_cross_entropy_with_logits(z @ w + b, y) + l2 * (w * w).sum()
            value.backward()
            return value

        opt.step(loss)
    return {"mean": mean, "std": std, "weight": w.detach(), "bias": b.detach()}


def fingerprint(model) -> str:
    """What tells models apart for the cache: config, activation dtype, the kinds of its weights,
    and its greedy next token at every position of a fixed probe (token ids made from PROBE's
    characters, so that it needs no tokenizer)."""
    kinds = sorted({f"{type(m).__name__}:{getattr(m, 'kind', '')}" for m in model.modules() if hasattr(m, "weight")})
    probe = [(ord(c) * 7919) % model.cfg.vocab_size for c in PROBE]
    _, logits, _ = forward(model, probe, (), logits=True)
    text = json.dumps([repr(model.cfg), str(model.dtype), kinds, logits[0].argmax(-1).tolist()])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def cache_path(model, home: Path | None = None) -> Path:
    """Where the router for this model, labels and recipe lives."""
    from specsot_mq.pull import specsot_home

    labels = hashlib.sha256((LABELS / "train.jsonl").read_bytes() + (LABELS / "valid.jsonl").read_bytes()).hexdigest()
    key = hashlib.sha256(f"{fingerprint(model)}|{labels}|{RECIPE}".encode()).hexdigest()[:20]
    return (home or specsot_home()) / "routers" / f"{key}.safetensors"
