"""Sampling parameters and the token sampler (greedy, temperature, top-k, top-p, seeded)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specsot_mq.errors import SpecSotError
from specsot_mq.quant import native


# The CLI's repeat_stop (ask, run, chat) and the benchmarks': SmolLM2-135M often loops, and a run
# of 16 tokens seen twice in one output is a loop.
REPEAT_STOP = 16


@dataclass(slots=True)
class SamplingParams:
    """How one request is decoded. temperature 0 means greedy."""

    max_tokens: int = 256
    temperature: float = 0.0
    top_k: int = 0  # 0 = no limit
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()  # stop strings; the output ends before the first one
    ignore_eos: bool = False
    repeat_stop: int = 0  # end the output when its last N tokens already ran earlier in it (a loop); 0 = off
    # Stop strings count only past the output's leading whitespace: with stop "\n\n", an output
    # that opens with a blank line runs on to the end of its first paragraph (a SoT point).
    stop_after_text: bool = False
    # End the output (finish "repeat") at the end of a line that repeats an earlier line, ignoring
    # case, a leading list number and punctuation: a SoT skeleton listing its points again.
    stop_repeated_line: bool = False
    # With stop_repeated_line: a list item that runs on inside a line ("1. a 2. b") starts a line
    # of its own, so a skeleton that lists its points again on one line ends too.
    stop_repeated_item: bool = False

    def __post_init__(self):
        checks = [
            (self.max_tokens >= 1, f"max_tokens must be at least 1, got {self.max_tokens}"),
            (self.temperature >= 0, f"temperature must be >= 0 (0 = greedy), got {self.temperature}"),
            (self.top_k >= 0, f"top_k must be >= 0 (0 = off), got {self.top_k}"),
            (0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p}"),
            (self.repeat_stop >= 0, f"repeat_stop must be >= 0 (0 = off), got {self.repeat_stop}"),
        ]
        for ok, message in checks:
            if not ok:
                raise SpecSotError(message)
        self.stop = tuple(s for s in self.stop if s)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """The argmax over the last dimension (the first index on a tie, as argmax): float32 logits on
    a CPU with the native kernels through their scan (a fraction of torch's time on a step's few
    rows), others through torch.max (on CPU, over a large vocabulary in bf16, argmax is several
    times slower: benchmarks/HISTORY.md)."""
    if logits.dtype == torch.float32 and logits.device.type == "cpu" and logits.numel() and (kernel := native()):
        return kernel.greedy(logits)
    return logits.max(dim=-1).indices


class Sampler:
    """Draws tokens for one request; owns its random generator so a seed reproduces the output."""

    def __init__(self, params: SamplingParams, device: torch.device | str = "cpu"):
        self.params = params
        self.generator = None
        if not params.greedy:
            self.generator = torch.Generator(device=device)
            if params.seed is None:
                self.generator.seed()
            else:
                self.generator.manual_seed(params.seed)

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """The distribution [N, V] actually sampled from: temperature, then top-k, then top-p."""
        p = self.params
        logits = logits.float() / max(p.temperature, 1e-5)
        if p.top_k:
            kth = torch.topk(logits, min(p.top_k, logits.shape[-1]), dim=-1).values[..., -1:]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        probs = torch.softmax(logits, dim=-1)
        if p.top_p < 1:
            probs = top_p_filter(probs, p.top_p)
        return probs

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        """One token id per row of logits [N, V]."""
        if self.params.greedy:
            return greedy_tokens(logits)
        return sample(self.probs(logits), self.generator)


# Top-p looks at this many of the most likely tokens first; only a row whose kept tokens reach past
# them (a flat distribution) sorts its whole vocabulary.
TOP_P_CANDIDATES = 1024


def top_p_filter(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """probs [N, V] renormalised over each row's nucleus: a token is dropped when the mass of the
    more likely tokens before it already reaches top_p (so at least one is kept). Sorting a 49k
    vocabulary is slow on a CPU (`benchmarks/step.py`, its sampling table); the
    nucleus is usually among the top few hundred, and it lies within a row's top k exactly when
    its k-th token is dropped, so only the rows where that fails are sorted in full."""
    k = min(TOP_P_CANDIDATES, probs.shape[-1])
    top, order = torch.topk(probs, k, dim=-1)  # sorted, most likely first
    out = _nucleus(probs, top, order, top_p)
    wide = (top.cumsum(-1) - top)[:, -1] < top_p  # the k-th kept: the nucleus may reach past it
    if k < probs.shape[-1] and bool(wide.any()):
        rows = wide.nonzero().squeeze(1)
        out[rows] = _nucleus(probs[rows], *torch.sort(probs[rows], dim=-1, descending=True), top_p)
    return out / out.sum(-1, keepdim=True)


def _nucleus(probs: torch.Tensor, top: torch.Tensor, order: torch.Tensor, top_p: float) -> torch.Tensor:
    """probs' most likely tokens `top` (at `order`, most likely first) cut at top_p, in place of probs."""
    kept = top.masked_fill((top.cumsum(-1) - top) >= top_p, 0.0)
    return torch.zeros_like(probs).scatter_(-1, order, kept)


def sample(probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """One index per row of probs [N, V] (rows need not sum to 1), drawn by inverting the
    cumulative distribution with one uniform number per row: the same distribution as
    torch.multinomial, which is far slower over a 49k vocabulary on CPU. A token of probability
    0 is never drawn (the first index whose cumulative mass exceeds the draw)."""
    cdf = probs.float().cumsum(-1)
    total = cdf[:, -1:]
    u = torch.rand(probs.shape[0], 1, generator=generator, device=probs.device) * total
    u = torch.minimum(u, torch.nextafter(total, torch.zeros_like(total)))  # below the total, even rounded
    return torch.searchsorted(cdf, u, right=True).squeeze(-1)
