"""Prompt lookup's n-gram index: what it proposes, and that building it token by token equals
building it at once."""

import pytest

from specsot_mq.lookup import History, ListTokens, NgramIndex

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


# A list's tokens for the tests: number n is its digits as tokens 10 + digit, "." is 1, a newline 2
# and a blank line 3; words are 50 and up.
DOT, NL, BLANK = 1, 2, 3
LISTS = ListTokens({n: tuple(10 + int(c) for c in str(n)) for n in range(1, ListTokens.top + 2)}, DOT,
                   frozenset({NL, BLANK}))  # fmt: skip
ONE, TWO, THREE, NINE = (10 + 1,), (10 + 2,), (10 + 3,), (10 + 9,)
LIST_CASES = [
    ("after an item's line, the next number, the dot and what followed the last one's dot",
     [*ONE, DOT, 50, 51, NL, *TWO, DOT, 52, 53, NL], 3, [*THREE, DOT, 52]),
    ("k bounds it", [*ONE, DOT, 50, NL], 2, [*TWO, DOT]),
    ("9 is followed by 10, two tokens", [60, NL, *NINE, DOT, 50, NL], 4, [11, 10, DOT, 50]),
    ("a blank line ends an item too", [*ONE, DOT, 50, BLANK], 2, [*TWO, DOT]),
    ("a line that is no item: the n-gram guess", [50, 51, NL, 50, 51, NL], 2, [50, 51]),
    ("a number inside a line is no item: the n-gram guess",
     [60, *ONE, DOT, 50, NL, 60, *ONE, DOT, 50, NL], 2, [60, *ONE]),
    ("nothing past the largest number guessed", [*[10 + int(c) for c in str(ListTokens.top + 1)], DOT, 50, NL], 2, []),
]


@pytest.mark.parametrize("name, tokens, k, want", LIST_CASES, ids=[c[0] for c in LIST_CASES])
def test_numbered_list_guesses(name, tokens, k, want):
    assert NgramIndex(tokens, lists=LISTS).propose(k) == want


class WordTokenizer:
    """Encodes from a fixed table of whole strings (enough of the API for ListTokens.of)."""

    def __init__(self, table):
        self.table = table

    def encode(self, text, add_special_tokens=True):
        return self.table(text)


def test_history_guesses_where_the_sequence_holds_no_match_and_never_across_outputs():
    """A sequence's own earlier tokens come first; else what followed its suffix in an earlier
    output, up to that output's end; the History keeps the newer half of what it holds when full."""
    history = History(max_tokens=12)
    history.add([1, 2, 3, 4, 5])
    history.add([7, 8, 9])
    assert NgramIndex([10, 2, 3], history=history).propose(2) == [4, 5]  # from the first output
    assert NgramIndex([10, 4], history=history).propose(3) == [5]  # not past its end
    assert NgramIndex([10, 5], history=history).propose(2) == []  # an output's last token leads nowhere
    assert NgramIndex([3, 11, 3], history=history).propose(2) == [11, 3]  # its own tokens first
    assert NgramIndex([10, 2, 3]).propose(2) == []  # no history, no guess
    history.add([20, 21, 22])  # 10 + 4 tokens and separators: over 12, the older half goes
    assert NgramIndex([20], history=history).propose(2) == [21, 22]
    assert NgramIndex([1, 2], history=history).propose(2) == []
    assert len(history.index.tokens) <= 12


def test_list_tokens_come_from_the_tokenizer():
    marks = {".": [DOT], "\n": [NL], "\n\n": [BLANK]}
    digits = lambda text: [10 + int(c) for c in text] if text.isdigit() else marks[text]  # noqa: E731
    lists = ListTokens.of(WordTokenizer(digits))
    assert lists.numbers[12] == (11, 12) and lists.dot == DOT and lists.newlines == {NL, BLANK}
    # a newline written as two tokens: no guesses
    assert ListTokens.of(WordTokenizer(lambda text: [NL, NL] if text == "\n" else digits(text))) is None


@pytest.mark.slow
def test_a_skeleton_takes_fewer_steps_with_list_guesses_and_the_same_tokens(default_model_dir):
    """On the real model, a SoT skeleton (a numbered list) decoded with prompt lookup: the list
    guesses get accepted, so fewer steps give the same tokens."""
    import torch

    from specsot_mq.generate import Generator
    from specsot_mq.loader import load_model
    from specsot_mq.lookup import History
    from specsot_mq.prompts import load_format
    from specsot_mq.sampling import SamplingParams
    from specsot_mq.speculative import TreeParams
    from specsot_mq.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(default_model_dir)
    gen = Generator(load_model(default_model_dir, dtype=torch.float32), tokenizer, max_len=1024,
                    tree=TreeParams(lookup=2))  # fmt: skip
    assert gen.lists is not None and gen.lists.dot == tokenizer.encode(".", add_special_tokens=False)[0]
    prompt = load_format("sot").skeleton_ids(tokenizer, "How can I get better at public speaking?")
    params = SamplingParams(max_tokens=64, stop=("\n\n",))
    with_lists = gen.generate(prompt, params)
    gen.lists, gen.history = None, History()  # and no earlier output to copy from
    without = gen.generate(prompt, params)
    assert with_lists.token_ids == without.token_ids and with_lists.text.count("\n") >= 2
    assert with_lists.steps < without.steps
    again = gen.generate(prompt, params)  # its History holds that same output now
    assert again.token_ids == without.token_ids and again.steps < without.steps
