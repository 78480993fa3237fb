"""The token sampler (greedy, temperature, top-k, min-p, top-p, seeded) for the settings of sampling_params.py."""

from __future__ import annotations

import torch

from specsot_mq.quant import native
from specsot_mq.sampling_params import REPEAT_STOP, SamplingParams  # noqa: F401 (the decoders import them from here)


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
        """The distribution [N, V] actually sampled from: temperature, then top-k, then min-p (a
        token less likely than min_p times the likeliest is dropped), then top-p."""
        p = self.params
        logits = logits.float() / max(p.temperature, 1e-5)
        if p.top_k:
            kth = torch.topk(logits, min(p.top_k, logits.shape[-1]), dim=-1).values[..., -1:]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        probs = torch.softmax(logits, dim=-1)
        if p.min_p > 0:
            probs = probs.masked_fill(probs < p.min_p * probs.amax(-1, keepdim=True), 0.0)
            probs = probs / probs.sum(-1, keepdim=True)
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
