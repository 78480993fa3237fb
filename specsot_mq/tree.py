"""EAGLE-2 dynamic draft trees: which draft tokens to verify, as pure tensor logic (no model).

The search grows level by level for B sequences at once. The root's children come from the draft
distribution at the last processed position; at each deeper level the `topk` best nodes of the
level above (the beam) each get their `topk` best children; at the end the best `num_nodes` nodes
overall are kept. Scores never increase from a node to its children nor from a child to its later
siblings, and ties go to the node made first, so the kept set is closed under ancestors and each
node's kept children are a prefix of its children in draw order.

Greedy: the children are the top-k draft tokens and the score is the cumulative draft log-prob
(EAGLE-2 as published). Sampling: the children are drawn without replacement from the draft
distribution q (Gumbel-top-k) and the score is the Gumbel-perturbed cumulative log-prob of
stochastic beam search (Kool et al., 2019). A node's perturbed score does not depend on which
token it drew, so what gets kept never peeks at a candidate's own identity; that keeps recursive
rejection sampling over the tree lossless (a plain log-prob ranking would favour likely drafts
and bias the output).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

NEG_INF = float("-inf")


@dataclass(slots=True)
class DraftTree:
    """One sequence's tree to verify: the root (already decided) first, then the drafted nodes in
    creation order, so every parent comes before its children and siblings are in draw order."""

    tokens: list[int]  # base token ids, root first
    parents: list[int]  # parent index of each node; -1 for the root
    depths: list[int]  # 0 for the root
    # [N+1, N+1] bool, mask[i, j] = node j is node i or one of its ancestors; None for a chain (each
    # node the child of the one before: the mask is causal)
    mask: torch.Tensor | None
    positions: list[int]  # rope positions: root position + depth
    q: torch.Tensor | None  # [N+1, Vd] draft distribution at each node (unused for leaves); None when greedy

    @property
    def size(self) -> int:
        """Tokens in the verify pass (root included)."""
        return len(self.parents)

    def attention_mask(self) -> torch.Tensor:
        """The mask, also for a chain."""
        return self.mask if self.mask is not None else torch.ones(self.size, self.size, dtype=torch.bool).tril()

    def children(self) -> list[list[int]]:
        """Each node's children, in draw order."""
        kids: list[list[int]] = [[] for _ in self.parents]
        for i, p in enumerate(self.parents[1:], start=1):
            kids[p].append(i)
        return kids


@dataclass(slots=True)
class TreeSearch:
    """Every node drawn so far for B sequences, in creation order (the root is implicit)."""

    ids: torch.Tensor  # [B, M] draft-vocabulary ids
    parents: torch.Tensor  # [B, M] parent node index; -1 = the root
    depths: torch.Tensor  # [B, M] 1 for the root's children
    scores: torch.Tensor  # [B, M] ranking score (see the module docstring); -inf = no such node
    logq: torch.Tensor  # [B, M] cumulative draft log-prob (where the children's Gumbel noise is centred)
    beam: torch.Tensor  # [B, K] nodes whose children the next level draws, best first


def draw_children(
    logq: torch.Tensor, score: torch.Tensor, cum: torch.Tensor, k: int, generator: torch.Generator | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The k children of each parent, best first.

    logq [..., Vd]: each parent's draft log-probs (-inf = impossible); score, cum [...]: the parent's
    ranking score and cumulative log-prob. generator None = greedy (top-k); otherwise Gumbel-top-k,
    i.e. k draws without replacement from exp(logq) in draw order. Returns (ids, scores, cum) [..., k];
    children that do not exist (fewer than k possible tokens) score -inf.
    """
    k = min(k, logq.shape[-1])
    cum_all = cum[..., None] + logq
    if generator is None:
        child_cum, ids = cum_all.topk(k, dim=-1)
        child_score = score[..., None] + (child_cum - cum[..., None])
    else:
        u = torch.rand(cum_all.shape, generator=generator, device=cum_all.device).clamp_(min=1e-20)
        perturbed, ids = (cum_all - torch.log(-torch.log(u))).topk(k, dim=-1)
        child_cum = cum_all.gather(-1, ids)
        child_score = _condition_on_max(perturbed, perturbed[..., :1], score[..., None])
    # A float guard: children never outrank their parent, so the kept set stays ancestor-closed.
    child_score = torch.minimum(child_score, score[..., None])
    ok = torch.isfinite(child_cum) & torch.isfinite(score)[..., None]
    return ids, child_score.masked_fill(~ok, NEG_INF), child_cum


def _condition_on_max(g: torch.Tensor, z: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """Gumbels g with maximum z, shifted so their maximum is t (Kool et al. 2019, appendix B, the
    numerically stable form)."""
    a = (g - z).clamp(max=0)
    log1mexp = torch.where(a > -0.693, torch.log(-torch.expm1(a)), torch.log1p(-torch.exp(a)))
    v = t - g + log1mexp
    out = t - v.clamp(min=0) - torch.log1p(torch.exp(-v.abs()))
    return torch.where(torch.isfinite(g), out, NEG_INF)


def start_search(root_logq: torch.Tensor, k: int, generator: torch.Generator | None = None) -> TreeSearch:
    """Level 1: the root's k children (root_logq [B, Vd]); all of them form the first beam."""
    b = root_logq.shape[0]
    zero = root_logq.new_zeros(b)
    ids, score, cum = draw_children(root_logq, zero, zero, k, generator)
    k = ids.shape[1]
    index = torch.arange(k, device=ids.device).expand(b, k)
    return TreeSearch(ids, torch.full_like(ids, -1), torch.ones_like(ids), score, cum, index)


def grow_search(
    search: TreeSearch, beam_logq: torch.Tensor, k: int, generator: torch.Generator | None = None
) -> TreeSearch:
    """One level deeper: every beam node's k children (beam_logq [B, K, Vd] are the beam nodes'
    draft log-probs); the best k of the new level become the next beam."""
    b, width = search.beam.shape
    score, cum = search.scores.gather(1, search.beam), search.logq.gather(1, search.beam)
    ids, child_score, child_cum = draw_children(beam_logq, score, cum, k, generator)
    kk = ids.shape[-1]
    m = search.ids.shape[1]
    parents = search.beam[:, :, None].expand(b, width, kk).reshape(b, -1)
    child_score = child_score.reshape(b, -1)
    depth = search.depths[:, -1:] + 1
    # Stable sort: among equal scores the earlier-made node wins, as in the final selection.
    order = torch.sort(child_score, dim=1, descending=True, stable=True).indices[:, : min(k, child_score.shape[1])]
    return TreeSearch(
        ids=torch.cat([search.ids, ids.reshape(b, -1)], 1),
        parents=torch.cat([search.parents, parents], 1),
        depths=torch.cat([search.depths, depth.expand(b, parents.shape[1])], 1),
        scores=torch.cat([search.scores, child_score], 1),
        logq=torch.cat([search.logq, child_cum.reshape(b, -1)], 1),
        beam=m + order,
    )


def select_nodes(search: TreeSearch, num_nodes: int) -> list[list[int]]:
    """The best `num_nodes` nodes of each sequence (fewer where fewer exist), in creation order.
    Ties go to the earlier node, so the result is closed under ancestors."""
    order = torch.sort(search.scores, dim=1, descending=True, stable=True).indices[:, :num_nodes]
    finite = torch.isfinite(search.scores.gather(1, order))
    return [sorted(o[f].tolist()) for o, f in zip(order, finite)]


def make_tree(search: TreeSearch, row: int, kept: list[int], root_token: int, root_position: int,
              d2t: torch.Tensor, q: torch.Tensor | None = None) -> DraftTree:  # fmt: skip
    """The DraftTree of sequence `row` from its kept nodes (select_nodes). d2t maps draft ids to
    base ids; q is DraftTree.q (the draft distribution at the root and each kept node, in tree
    order), or None when greedy."""
    where = {-1: 0} | {node: i + 1 for i, node in enumerate(kept)}  # search node -> tree index
    parents = [-1] + [where[p] for p in search.parents[row, kept].tolist()]  # KeyError: not ancestor-closed
    dev = search.ids.device
    mask = _ancestor_mask(parents, dev)
    kept_t = torch.tensor(kept, dtype=torch.long, device=dev)
    tokens = [root_token] + d2t[search.ids[row, kept_t]].tolist()
    depths = [0] + search.depths[row, kept_t].tolist()
    return DraftTree(tokens, parents, depths, mask, [root_position + d for d in depths], q)


def one_level(root_token: int, root_position: int, children: list[int], device) -> DraftTree:
    """A greedy tree of one level: the root and its children (base ids, best first), what
    make_tree builds from a search that stopped at its first level, without the search."""
    parents = [-1] + [0] * len(children)
    depths = [0] + [1] * len(children)
    return DraftTree([root_token, *children], parents, depths, _ancestor_mask(parents, device),
                     [root_position + d for d in depths], None)  # fmt: skip


def chain(root_token: int, root_position: int, tokens: list[int]) -> DraftTree:
    """A greedy chain (top-k 1): the root and each level's one guess (base ids), what make_tree
    builds from a search of one child a level, without the search; causal, so no mask."""
    n = len(tokens)
    return DraftTree([root_token, *tokens], list(range(-1, n)), list(range(n + 1)), None,
                     [root_position + d for d in range(n + 1)], None)  # fmt: skip


def graft(tree: DraftTree, chain: list[int]) -> DraftTree:
    """The tree with one more path from its root: `chain`'s tokens (base ids; prompt lookup, see
    lookup.py). Where the tree already holds a prefix of the chain, the path follows it, so no
    node has two children with the same token (greedy acceptance then has one way down); the rest
    hangs below as new nodes, appended in order. Greedy only: grafted nodes have no draft
    distribution, so tree.q must be None."""
    if tree.q is not None:
        raise ValueError("graft is for greedy trees (a grafted node has no draft distribution)")
    tokens, parents = list(tree.tokens), list(tree.parents)
    kids = tree.children()
    node, new = 0, []
    for token in chain:
        same = next((c for c in kids[node] if tokens[c] == token), None) if not new else None
        if same is None:
            parents.append(node)
            tokens.append(token)
            new.append(len(parents) - 1)
            node = new[-1]
        else:
            node = same
    if not new:
        return tree
    depths = list(tree.depths)
    for i in new:
        depths.append(depths[parents[i]] + 1)
    mask = _ancestor_mask(parents, tree.mask.device if tree.mask is not None else "cpu")
    return DraftTree(tokens, parents, depths, mask, [tree.positions[0] + d for d in depths], None)


def _ancestor_mask(parents: list[int], device) -> torch.Tensor | None:
    """DraftTree.mask of a tree with these parents: None for a chain (each node the child of the one
    before), else mask[i, j] = node j is node i or one of its ancestors."""
    n = len(parents)
    if parents == list(range(-1, n - 1)):
        return None
    mask = torch.zeros(n, n, dtype=torch.bool, device=device)
    for i, p in enumerate(parents):
        if p >= 0:
            mask[i] = mask[p]
        mask[i, i] = True
    return mask


def root_only(root_token: int, root_position: int) -> DraftTree:
    """A tree with nothing drafted: verifying it is a plain decoding step."""
    return DraftTree(tokens=[root_token], parents=[-1], depths=[0], mask=None, positions=[root_position], q=None)
