"""Prompt lookup's n-gram index: what it proposes, and that building it token by token equals
building it at once."""

import pytest

from specsot_mq.lookup import NgramIndex

CASES = [
    # (name, sequence, k, proposal)
    ("the tokens after the last n-gram's earlier occurrence", [1, 2, 3, 9, 1, 2, 3], 3, [9, 1, 2]),
    ("k bounds the proposal", [1, 2, 3, 9, 8, 7, 1, 2, 3], 2, [9, 8]),
    ("a proposal stops at the sequence's end", [5, 6, 5], 4, [6, 5]),
    ("the latest earlier occurrence wins", [4, 1, 4, 2, 4], 1, [2]),
    ("the longest matching suffix wins over a later shorter one", [7, 8, 1, 9, 8, 2, 7, 8], 1, [1]),
    ("a shorter suffix when the longest never occurred", [6, 3, 5, 0, 4, 3], 2, [5, 0]),
    ("nothing when the last token never occurred before", [1, 2, 3, 4], 3, []),
    ("a loop proposes its own continuation", [1, 2, 1, 2, 1, 2], 4, [1, 2]),
    ("k = 0 proposes nothing", [1, 2, 1], 0, []),
    ("an empty sequence proposes nothing", [], 3, []),
]


@pytest.mark.parametrize("name, tokens, k, want", CASES, ids=[c[0] for c in CASES])
def test_proposals(name, tokens, k, want):
    assert NgramIndex(tokens).propose(k) == want


def test_extending_token_by_token_equals_building_at_once():
    seq = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2, 3, 8, 4, 6, 2, 6, 4, 3, 3, 8, 3, 2, 7, 9, 5]
    grown = NgramIndex(seq[:3])
    for i in range(3, len(seq)):
        grown.extend(seq[i : i + 1])
        whole = NgramIndex(seq[: i + 1])
        assert grown.after == whole.after and grown.propose(5) == whole.propose(5)


def test_n_range_is_checked():
    with pytest.raises(ValueError, match="min_n"):
        NgramIndex([], max_n=1, min_n=2)
