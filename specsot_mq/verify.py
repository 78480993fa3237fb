"""Which drafted tokens the base model accepts: a walk down the draft tree from its root.

Greedy: follow the base argmax while a child matches it; the argmax at the last accepted node is
the bonus token. The output is exactly plain greedy decoding.

Sampling: recursive rejection sampling without replacement (Jeon et al., "Recursive Speculative
Decoding", 2024). At a node with target distribution p and children c_1..c_m drawn in that order
without replacement from the draft distribution q: accept c_j with probability min(1, p/q at c_j);
on rejection p <- normalize(max(p - q, 0)) and q <- q without c_j, renormalised. When every child
is rejected (or at a leaf) the bonus token is drawn from the last p. Each emitted token then has
exactly the target distribution, provided each node's kept children are a prefix of its draws and
keeping a child never depends on which token it drew (tree.py sees to both). The EAGLE reference
code's `qx = 1.0` rule treats every draft as a certain proposal: also lossless, but it accepts a
child with probability p(c) instead of min(1, p(c)/q(c)), so fewer tokens per step
(benchmarks/HISTORY.md).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from specsot_mq.sampling import sample
from specsot_mq.tree import DraftTree


@dataclass(slots=True)
class Acceptance:
    """What verifying one tree decided."""

    nodes: list[int]  # accepted tree nodes from the root down (root excluded): the cache entries kept
    tokens: list[int]  # what the sequence gains: the accepted nodes' tokens, then the bonus token


def accept_greedy(tree: DraftTree, best: list[int]) -> Acceptance:
    """best: the base model's greedy token at every tree node (greedy_tokens of its logits [N+1, V];
    a decoder picks them for all its trees in one call)."""
    tokens, kids = tree.tokens, tree.children()
    node, nodes = 0, []
    while (nxt := next((c for c in kids[node] if tokens[c] == best[node]), None)) is not None:
        nodes.append(nxt)
        node = nxt
    return Acceptance(nodes, [tokens[i] for i in nodes] + [best[node]])


def accept_sampled(
    tree: DraftTree,
    target_logits: torch.Tensor,
    process: Callable[[torch.Tensor], torch.Tensor],
    d2t: torch.Tensor,
    generator: torch.Generator,
) -> Acceptance:
    """target_logits [N+1, V]: the base logits at every tree node; process turns rows of logits
    into the distribution actually sampled from (Sampler.probs). Only the rows on the walked path
    are processed: top-p sorts the whole vocabulary, which costs more than the walk itself.
    tree.q holds the draft distributions the children were drawn from (over draft ids, which d2t
    maps to base ids); generator: the request's random generator."""
    tokens, kids = tree.tokens, tree.children()
    node, nodes = 0, []
    while True:
        p = process(target_logits[node : node + 1])[0]
        if kids[node]:
            q = torch.zeros_like(p).index_copy_(0, d2t, tree.q[node].to(p.dtype))
        accepted = None
        for child in kids[node]:
            tok = tokens[child]
            if float(torch.rand((), generator=generator, device=p.device)) * float(q[tok]) < float(p[tok]):
                accepted = child
                break
            p = _residual(p, q)
            q[tok] = 0
            q = q / q.sum().clamp(min=1e-30)
        if accepted is None:
            bonus = int(sample(p[None], generator))
            return Acceptance(nodes, [tokens[i] for i in nodes] + [bonus])
        nodes.append(accepted)
        node = accepted


def _residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """normalize(max(p - q, 0)). If it has no mass, p <= q everywhere, so p == q and a rejection
    could only come from rounding: keep p."""
    r = (p - q).clamp_(min=0)
    total = float(r.sum())
    return r / total if total > 1e-12 else p


@dataclass(slots=True)
class SpecStats:
    """A decoder's counters (benchmarks, the engine's tau per phase). A step of B sequences counts
    B sequence-steps."""

    steps: int = 0  # sequence-steps verified
    drafted: int = 0  # tree nodes verified (root excluded)
    accepted: int = 0  # drafted tokens accepted (bonus tokens excluded)
    accepted_at_depth: list[int] = field(default_factory=list)  # [d-1]: accepted nodes at depth d
    lookup_accepted: int = 0  # of those, nodes that only prompt lookup had drafted
    draft_seconds: float = 0.0  # tree search, draft-head forwards and draft_extend
    verify_seconds: float = 0.0  # the base forward, acceptance and cache compaction

    @property
    def tau(self) -> float:
        """Mean tokens per sequence per verify step (vLLM's mean acceptance length)."""
        return 1 + self.accepted / self.steps if self.steps else 0.0

    def count(self, trees: list[DraftTree], results: list[Acceptance], drafted: list[int]) -> None:
        """One step's trees and what was accepted of them; drafted[i]: tree i's nodes before the
        prompt-lookup chain was grafted on (the nodes from then on are lookup's alone)."""
        self.steps += len(trees)
        for tree, res, n in zip(trees, results, drafted):
            self.drafted += tree.size - 1
            self.accepted += len(res.nodes)
            self.lookup_accepted += sum(node >= n for node in res.nodes)
            self.accepted_at_depth += [0] * (len(res.nodes) - len(self.accepted_at_depth))  # lookup paths go deeper
            for depth in range(len(res.nodes)):
                self.accepted_at_depth[depth] += 1
