"""The prompt-lookup (n-gram) draft proposer: its cases, and a brute-force reference over random
contexts on a tiny vocabulary, where n-grams recur often and ties are everywhere."""

from __future__ import annotations

import random

import numpy as np
import pytest

from baton.engine.speculation.ngram import NgramProposer


def reference(tokens: list[int], num_tokens: int, k: int, min_n: int, max_n: int) -> list[int]:
    """Obviously correct: for n from max_n down to min_n, the latest earlier start of the last n
    tokens wins, and the draft is what followed it, cut by the end of the context."""
    count = min(num_tokens, k)
    if count <= 0:
        return []
    length = len(tokens)
    for n in range(max_n, min_n - 1, -1):
        if n > length:
            continue
        suffix = tokens[length - n :]
        for start in range(length - n - 1, -1, -1):  # earlier starts, the latest first
            if tokens[start : start + n] == suffix:
                return tokens[start + n : start + n + count]
    return []


def propose(tokens: list[int], num_tokens: int = 4, k: int = 4, min_n: int = 1, max_n: int = 5):
    """The proposer's draft, checked to be the same for a numpy array (searched vectorised) and
    for a list or tuple searched in Python only, in numpy only, or in Python and then numpy."""
    proposer = NgramProposer(k, min_n, max_n)
    draft = proposer.propose(np.asarray(tokens, dtype=np.int64), num_tokens)
    assert proposer.propose(np.asarray(tokens, dtype=np.int32), num_tokens) == draft
    for python_candidates in (0, 1, 3, NgramProposer.python_candidates, len(tokens)):
        proposer.python_candidates = python_candidates
        assert proposer.propose(tokens, num_tokens) == draft, python_candidates
        assert proposer.propose(tuple(tokens), num_tokens) == draft, python_candidates
    assert all(type(token) is int for token in draft)
    return draft


def test_periodic_text_continues_into_the_suffix():
    # "a b" at 0 and 2 (and the suffix at 4): the latest earlier one, at 2, continues with 4, 5.
    assert propose([1, 2, 1, 2, 1, 2], min_n=2, max_n=2) == [1, 2]
    # The longest recurring n-gram, "a b a b", starts at 0 and continues with positions 4, 5.
    assert propose([1, 2, 1, 2, 1, 2], min_n=1, max_n=5) == [1, 2]
    assert propose([7] * 10, num_tokens=3, k=3, min_n=3, max_n=3) == [7]


def test_most_recent_occurrence_is_chosen():
    # "5 6" occurs at 0 (followed by 1 1) and at 4 (followed by 2 2); the suffix is "5 6".
    tokens = [5, 6, 1, 1, 5, 6, 2, 2, 9, 5, 6]
    assert propose(tokens, min_n=2, max_n=2) == [2, 2, 9, 5]


def test_longest_n_preferred_over_a_more_recent_shorter_match():
    # The suffix "3 5 6": "5 6" occurs most recently at 5 (followed by 8), but "3 5 6" only at 0.
    tokens = [3, 5, 6, 7, 0, 5, 6, 8, 3, 5, 6]
    assert propose(tokens, num_tokens=2, k=2, min_n=1, max_n=3) == [7, 0]
    assert propose(tokens, num_tokens=2, k=2, min_n=1, max_n=2) == [8, 3]


def test_falls_back_to_a_shorter_n():
    # "1 2 3" does not recur, "2 3" does.
    tokens = [2, 3, 4, 5, 1, 2, 3]
    assert propose(tokens, min_n=2, max_n=3) == [4, 5, 1, 2]
    assert propose(tokens, min_n=1, max_n=5) == [4, 5, 1, 2]


def test_min_n_is_respected():
    # Only "3" recurs; with min_n 2 that is too short to count.
    tokens = [3, 4, 5, 6, 3]
    assert propose(tokens, min_n=1, max_n=3) == [4, 5, 6, 3]
    assert propose(tokens, min_n=2, max_n=3) == []


def test_no_match():
    assert propose([1, 2, 3, 4, 5]) == []
    assert propose([]) == []
    assert propose([1]) == []


def test_num_tokens_capped_by_num_speculative_tokens():
    tokens = [1, 2, 3, 4, 5, 6, 7, 8, 1]
    assert propose(tokens, num_tokens=2, k=4) == [2, 3]
    assert propose(tokens, num_tokens=8, k=3) == [2, 3, 4]


def test_num_tokens_zero():
    assert propose([1, 2, 1, 2], num_tokens=0) == []


def test_continuation_cut_by_the_end_of_the_context():
    assert propose([4, 9, 8, 4], num_tokens=4, k=4) == [9, 8, 4]
    assert propose([4, 9, 4], num_tokens=4, k=4) == [9, 4]


def test_context_shorter_than_n():
    # Two tokens cannot hold an earlier occurrence of a 2-gram.
    assert propose([1, 1], min_n=2, max_n=3) == []
    # max_n longer than the context: shorter n still match.
    assert propose([1, 1, 1], min_n=1, max_n=5) == [1]


def test_rejects_bad_configuration():
    with pytest.raises(ValueError):
        NgramProposer(0, 1, 2)
    with pytest.raises(ValueError):
        NgramProposer(4, 0, 2)
    with pytest.raises(ValueError):
        NgramProposer(4, 3, 2)


@pytest.mark.parametrize(
    ("k", "min_n", "max_n"), [(1, 1, 1), (4, 1, 3), (4, 2, 5), (3, 3, 3), (5, 1, 5), (2, 4, 6)]
)
@pytest.mark.parametrize("vocab", [2, 3, 4])
def test_matches_brute_force(k: int, min_n: int, max_n: int, vocab: int):
    rng = random.Random(1000 * k + 100 * min_n + 10 * max_n + vocab)
    for _ in range(60):
        tokens = [rng.randrange(vocab) for _ in range(rng.randrange(61))]
        num_tokens = rng.randrange(k + 3)
        expected = reference(tokens, num_tokens, k, min_n, max_n)
        assert propose(tokens, num_tokens, k, min_n, max_n) == expected, tokens
