"""The prompt-lookup proposer's index."""

from __future__ import annotations

from ruvllm.speculative.ngram import NgramIndex


def index(tokens: list[int], n_min: int = 1, n_max: int = 3) -> NgramIndex:
    idx = NgramIndex(n_min, n_max)
    idx.extend(tokens)
    return idx


def test_proposes_what_followed_the_longest_matching_suffix() -> None:
    # suffix (7, 8): its earlier occurrence is followed by 9 10 11; (8) alone was last followed by 5
    idx = index([7, 8, 9, 10, 11, 1, 8, 5, 6, 7, 8])
    assert idx.propose(3) == [9, 10, 11]
    assert idx.propose(1) == [9]


def test_latest_occurrence_wins_and_the_suffix_never_matches_itself() -> None:
    idx = index([1, 2, 3, 1, 2, 4, 1, 2])
    assert idx.propose(2) == [4, 1]  # (1, 2) last seen before the suffix: followed by 4
    assert index([5, 6, 7]).propose(4) == []  # nothing repeats


def test_a_proposal_stops_at_the_sequence_end() -> None:
    assert index([1, 2, 1, 2]).propose(5) == [1, 2]  # the match at 0..1 is followed by only 2 tokens


def test_incremental_extension_equals_building_at_once() -> None:
    tokens = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2, 3, 8, 4, 6, 2, 6, 4, 3, 3, 8, 3, 2, 7, 9, 5]
    grown = NgramIndex(1, 4)
    for t in tokens:
        grown.extend([t])
        assert grown.propose(3) == index(grown.tokens, 1, 4).propose(3)


def test_n_min_bounds_the_shortest_match() -> None:
    assert index([1, 9, 2, 1], n_min=2).propose(2) == []  # only a 1-gram repeats
    assert index([1, 9, 2, 1], n_min=1).propose(2) == [9, 2]
