"""Draft trees and acceptance as pure logic: hand-made draft log-probs give the expected trees, and
rejection sampling over chains and trees keeps the target distribution (chi-square)."""

import math

import pytest
import torch

from specsot_mq.tree import graft, grow_search, make_tree, one_level, root_only, select_nodes, start_search
from specsot_mq.sampling import greedy_tokens
from specsot_mq.verify import accept_greedy, accept_sampled


def build(draft, vd, topk, depth, num_nodes, root=100, position=7, generator=None):
    """One tree from draft(path of draft ids) -> probabilities [vd]; d2t is the identity."""
    logq = lambda paths: torch.log(torch.tensor([[draft(tuple(p)) for p in row] for row in paths]))  # noqa: E731
    search = start_search(logq([[()]])[:, 0], topk, generator)
    for _ in range(1, depth):
        paths = [[path(search, 0, int(n)) for n in search.beam[0]]]
        search = grow_search(search, logq(paths), topk, generator)
    kept = select_nodes(search, num_nodes)[0]
    return make_tree(search, 0, kept, root, position, torch.arange(vd))


def path(search, row, node):
    out = []
    while node >= 0:
        out.append(int(search.ids[row, node]))
        node = int(search.parents[row, node])
    return out[::-1]


def table(rows):
    """draft(path) from {path: probabilities}; unlisted paths are uniform over 6 tokens."""
    return lambda p: rows.get(p, [1 / 6] * 6)


BRANCHY = table({(): [0.6, 0.4, 0, 0, 0, 0], (0,): [0, 0, 0, 0, 0.75, 0.25], (1,): [0, 0, 0.2, 0.8, 0, 0],
                 (0, 4): [1, 0, 0, 0, 0, 0], (1, 3): [0, 0.6, 0.4, 0, 0, 0], (0, 5): [0, 0, 0, 0, 0, 1]})

CASES = [
    # (name, draft, topk, depth, num_nodes, tokens after the root, parents, depths)
    ("chain follows the top token",
     table({(): [0, 0, 1, 0, 0, 0], (2,): [0, 0, 0, 0, 0.9, 0.1], (2, 4): [0.7, 0.3, 0, 0, 0, 0]}),
     1, 3, 3, [2, 4, 0], [-1, 0, 1, 2], [0, 1, 2, 3]),
    ("a small budget keeps the top of the chain", table({(): [0.6, 0.4, 0, 0, 0, 0], (0,): [0, 0, 0.8, 0.2, 0, 0]}),
     1, 3, 2, [0, 2], [-1, 0, 1], [0, 1, 2]),
    # a .6, b .4; a's only child aa .6 (ties its parent: the parent, made first, wins), ba .36, bb .04
    ("a deep likely node beats a shallow unlikely one", table({(): [0.6, 0.4, 0, 0, 0, 0], (0,): [0, 0, 0, 0, 1, 0],
                                                              (1,): [0, 0, 0.9, 0.1, 0, 0]}),
     2, 2, 2, [0, 4], [-1, 0, 1], [0, 1, 2]),
    ("kept nodes are listed parents first", table({(): [0.6, 0.4, 0, 0, 0, 0], (0,): [0, 0, 0, 0, 1, 0],
                                                  (1,): [0, 0, 0.9, 0.1, 0, 0]}),
     2, 2, 3, [0, 1, 4], [-1, 0, 0, 1], [0, 1, 1, 2]),
    # depth 2: (0,4) .45, (0,5) .15, (1,3) .32, (1,2) .08 -> the beam is (0,4), (1,3), so (0,5) and
    # (1,2) get no children even with room for every node
    ("only the beam is expanded", BRANCHY, 2, 3, 20, [0, 1, 4, 5, 3, 2, 0, 1, 2], [-1, 0, 0, 1, 1, 2, 2, 3, 5, 5],
     [0, 1, 1, 2, 2, 2, 2, 3, 3, 3]),
    # a .6, a4 .45, a40 .45, b .4, b3 .32, b31 .192 | b32 .128, a5 .15, b2 .08
    ("the budget keeps the best nodes", BRANCHY, 2, 3, 6, [0, 1, 4, 3, 0, 1], [-1, 0, 0, 1, 2, 3, 4],
     [0, 1, 1, 2, 2, 3, 3]),
    ("fewer possible tokens than topk: no phantom nodes", table({(): [1, 0, 0, 0, 0, 0], (0,): [0, 1, 0, 0, 0, 0]}),
     3, 2, 5, [0, 1], [-1, 0, 1], [0, 1, 2]),
]


@pytest.mark.parametrize("name, draft, topk, depth, num_nodes, tokens, parents, depths", CASES,
                         ids=[c[0] for c in CASES])  # fmt: skip
def test_tree_construction(name, draft, topk, depth, num_nodes, tokens, parents, depths):
    check_tree(build(draft, 6, topk, depth, num_nodes), tokens, parents, depths)


def check_tree(tree, tokens, parents, depths):
    """The tree (root 100 at position 7) has these tokens after the root, parents and depths,
    positions by depth, and the ancestor-or-self mask."""
    assert tree.tokens == [100] + tokens
    assert tree.parents == parents
    assert tree.depths == depths
    assert tree.positions == [7 + d for d in depths]
    expected = torch.eye(len(parents), dtype=torch.bool)
    for i in range(1, len(parents)):
        expected[i] |= expected[parents[i]]
    assert torch.equal(tree.attention_mask(), expected)
    assert (tree.mask is None) == (parents == list(range(-1, len(parents) - 1)))  # None: a chain


def test_mask_of_a_branching_tree_is_ancestor_or_self():
    tree = build(BRANCHY, 6, 2, 3, 6)
    assert tree.mask.int().tolist() == [
        [1, 0, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0, 0],
        [1, 0, 1, 0, 0, 0, 0],
        [1, 1, 0, 1, 0, 0, 0],
        [1, 0, 1, 0, 1, 0, 0],
        [1, 1, 0, 1, 0, 1, 0],
        [1, 0, 1, 0, 1, 0, 1],
    ]


@pytest.mark.parametrize("seed", range(5))
def test_sampled_trees_keep_ancestors_and_a_prefix_of_each_nodes_draws(seed):
    gen = torch.Generator().manual_seed(seed)
    probs = torch.softmax(torch.randn(8, generator=gen), 0).tolist()
    search = start_search(torch.log(torch.tensor([probs])), 3, gen)
    for _ in range(3):
        search = grow_search(search, torch.log(torch.tensor([[probs] * 3])), 3, gen)
    kept = set(select_nodes(search, 10)[0])
    assert len(kept) == 10
    parents = search.parents[0].tolist()
    for node in kept:
        assert parents[node] == -1 or parents[node] in kept
        # siblings are made in draw order; the one drawn just before must be kept too
        if node > 0 and parents[node - 1] == parents[node] and node % 3:
            assert node - 1 in kept


def test_greedy_acceptance_follows_the_argmax_and_adds_the_bonus():
    tree = build(BRANCHY, 6, 2, 3, 6)  # tokens: root, 0, 1, 4, 3, 0, 1
    logits = torch.full((7, 6), -5.0)
    for node, best in [(0, 1), (2, 3), (4, 2)]:  # root -> 1 (node 2) -> 3 (node 4) -> bonus 2
        logits[node, best] = 5.0
    res = accept_greedy(tree, greedy_tokens(logits).tolist())
    assert res.nodes == [2, 4] and res.tokens == [1, 3, 2]
    logits[0] = 0
    logits[0, 5] = 1.0  # no child of the root is 5
    assert accept_greedy(tree, greedy_tokens(logits).tolist()).tokens == [5]


GRAFTS = [
    # (name, chain, tokens after the root, parents) on build(BRANCHY, 6, 2, 3, 6): root, 0, 1, 4, 3, 0, 1
    # with parents -1, 0, 0, 1, 2, 3, 4
    ("a chain the tree holds adds nothing", [0, 4, 0], [0, 1, 4, 3, 0, 1], [-1, 0, 0, 1, 2, 3, 4]),
    ("a chain leaving the tree hangs below where it leaves", [1, 3, 5, 2],
     [0, 1, 4, 3, 0, 1, 5, 2], [-1, 0, 0, 1, 2, 3, 4, 4, 7]),
    ("a chain with a new first token is a new branch of the root", [2, 0, 4],
     [0, 1, 4, 3, 0, 1, 2, 0, 4], [-1, 0, 0, 1, 2, 3, 4, 0, 7, 8]),
    ("below a new node every token is new, even one the tree holds elsewhere", [0, 5, 1],
     [0, 1, 4, 3, 0, 1, 5, 1], [-1, 0, 0, 1, 2, 3, 4, 1, 7]),
    ("an empty chain adds nothing", [], [0, 1, 4, 3, 0, 1], [-1, 0, 0, 1, 2, 3, 4]),
]


@pytest.mark.parametrize("name, chain, tokens, parents", GRAFTS, ids=[g[0] for g in GRAFTS])
def test_graft_merges_a_chain_into_the_tree(name, chain, tokens, parents):
    tree = graft(build(BRANCHY, 6, 2, 3, 6), chain)
    depths = [0]
    for p in parents[1:]:
        depths.append(depths[p] + 1)
    check_tree(tree, tokens, parents, depths)
    for kids in tree.children():  # siblings never share a token: greedy acceptance has one way down
        assert len({tokens[k - 1] for k in kids}) == len(kids)


def test_greedy_acceptance_walks_a_grafted_chain():
    tree = graft(root_only(100, 7), [3, 1, 4])
    check_tree(tree, [3, 1, 4], [-1, 0, 1, 2], [0, 1, 2, 3])  # a chain: its mask is causal
    logits = torch.full((4, 6), -5.0)
    for node, best in [(0, 3), (1, 1), (2, 4), (3, 2)]:
        logits[node, best] = 5.0
    assert accept_greedy(tree, greedy_tokens(logits).tolist()).tokens == [3, 1, 4, 2]
    logits[2] = -5.0
    logits[2, 0] = 5.0  # the base disagrees at the third token
    assert accept_greedy(tree, greedy_tokens(logits).tolist()).tokens == [3, 1, 0]


def test_graft_refuses_a_sampled_tree():
    gen = torch.Generator().manual_seed(0)
    tree = build(BRANCHY, 6, 2, 2, 3, generator=gen)
    tree.q = torch.full((tree.size, 6), 1 / 6)
    with pytest.raises(ValueError, match="greedy"):
        graft(tree, [1])


# ---- lossless rejection sampling over trees ------------------------------------------------

V = 5
START = V  # the row of the state before the first token


def chi_square_p(observed: torch.Tensor, expected: torch.Tensor) -> float:
    """p-value of Pearson's chi-square test (categories expected > 0)."""
    keep = expected > 0
    assert observed[~keep].sum() == 0, "a token the target never emits was emitted"
    stat = ((observed[keep] - expected[keep]) ** 2 / expected[keep]).sum()
    df = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), stat.double() / 2))


def target_and_draft():
    """A Markov target p[state] and a draft q[depth][state] far from it: it misses token 4 at every
    depth (like a token outside the draft vocabulary), and its favourites differ by depth."""
    gen = torch.Generator().manual_seed(11)
    p = torch.softmax(torch.randn(V + 1, V, generator=gen), -1)
    p[2, 3] = 0  # a token the target never emits after 2
    p = p / p.sum(-1, keepdim=True)
    q = torch.softmax(2 * torch.randn(4, V + 1, V, generator=gen), -1)
    q[..., 4] = 0
    return p, q / q.sum(-1, keepdim=True)


def speculative_round(states, p, q, topk, depth, num_nodes, gen):
    """One draft-verify step for every trial at once (the trees are built batched)."""
    b = len(states)
    state = torch.tensor(states)
    search = start_search(torch.log(q[0, state]), topk, gen)
    for d in range(1, depth):
        tokens = search.ids.gather(1, search.beam)
        search = grow_search(search, torch.log(q[d, tokens]), topk, gen)
    # the draft distribution at every node: q[depth of the node][its token]; row 0 is the root
    node_q = torch.cat([q[0, state][:, None], q[search.depths.clamp(max=3), search.ids]], 1)
    kept = select_nodes(search, num_nodes)
    out = []
    for i in range(b):
        q_rows = node_q[i, [0] + [k + 1 for k in kept[i]]]  # the root, then each kept node
        tree = make_tree(search, i, kept[i], states[i], 0, torch.arange(V), q_rows)
        # the table rows are already the target distributions: nothing to process
        out.append(accept_sampled(tree, p[tree.tokens], lambda rows: rows, torch.arange(V), gen).tokens)
    return out


@pytest.mark.parametrize("topk, depth, num_nodes", [(1, 3, 3), (3, 3, 6)], ids=["chain", "tree"])
def test_rejection_sampling_keeps_the_target_distribution(topk, depth, num_nodes):
    p, q = target_and_draft()
    gen = torch.Generator().manual_seed(1234)
    trials = 4000
    emitted = speculative_round([START] * trials, p, q, topk, depth, num_nodes, gen)
    short = [i for i, t in enumerate(emitted) if len(t) < 2]
    for i, more in zip(short, speculative_round([emitted[i][0] for i in short], p, q, topk, depth, num_nodes, gen)):
        emitted[i] = emitted[i] + more
    first = torch.tensor([t[0] for t in emitted])
    pairs = torch.tensor([t[0] * V + t[1] for t in emitted])
    assert chi_square_p(torch.bincount(first, minlength=V).double(), trials * p[START].double()) > 0.01
    two = (p[START][:, None] * p[:V]).reshape(-1).double()
    assert chi_square_p(torch.bincount(pairs, minlength=V * V).double(), trials * two) > 0.01
    assert sum(len(t) for t in emitted) > 1.3 * trials  # the draft is used, not just the bonus


def test_chi_square_helper_rejects_a_wrong_distribution():
    observed = torch.tensor([600.0, 400.0])
    assert chi_square_p(observed, torch.tensor([500.0, 500.0])) < 1e-6
    assert math.isclose(chi_square_p(torch.tensor([500.0, 500.0]), torch.tensor([500.0, 500.0])), 1.0)


@pytest.mark.parametrize("k", [1, 2, 3])
def test_a_one_level_tree_is_what_the_search_keeps_of_its_first_level(k):
    """Speculative.draft's greedy one-level path (topk of the root's draft log-probs, one_level)
    builds the tree make_tree builds from the search stopped at its first level."""
    torch.manual_seed(k)
    logq = torch.log_softmax(torch.randn(3, 50), dim=-1)
    d2t = torch.randperm(200)[:50]
    search = start_search(logq, k)
    kept = select_nodes(search, k)
    best = logq.topk(k, dim=-1).indices
    for row in range(3):
        want = make_tree(search, row, kept[row], 7, 40, d2t)
        got = one_level(7, 40, d2t[best[row]].tolist(), "cpu")
        assert (got.tokens, got.parents, got.depths, got.positions) == (want.tokens, want.parents, want.depths, want.positions)
        assert (got.mask is None and want.mask is None) or torch.equal(got.mask, want.mask)
