"""The adaptive proposal count: what it picks for given acceptance and costs, and how it learns."""

from __future__ import annotations

from ruvllm.speculative.policy import PROBE_EVERY, SpeculationPolicy


def _with_alpha(alpha: float, **costs: float) -> SpeculationPolicy:
    p = SpeculationPolicy(prior=(10 * alpha, 10.0), **costs)
    assert p.length("a", 1) == 1  # the first offer is a probe
    return p


def test_picks_the_length_with_the_most_tokens_per_cost() -> None:
    p = _with_alpha(0.9, row_cost=0.2)
    assert p.length("a", 8) == 7  # (1 - 0.9^8) / 0.1 = 5.7 tokens for 2.4 steps; the 8th adds less than it costs
    assert p.length("a", 3) == 3  # never more than offered
    assert _with_alpha(0.1, row_cost=0.2).length("a", 8) == 0  # none pays
    assert _with_alpha(0.5, row_cost=0.01).length("a", 8) >= 4  # nearly free rows (a GPU): even 0.5 pays long
    assert _with_alpha(0.5, row_cost=0.2, draft_cost=0.6).length("a", 4) == 0  # an expensive draft: no


def test_rejections_turn_it_off_and_probes_come_back() -> None:
    p = SpeculationPolicy(row_cost=0.2)
    assert p.length("a", 4) == 1
    for _ in range(6):
        p.observe("a", 2, 0)
    lengths = [p.length("a", 4) for _ in range(4 * PROBE_EVERY)]
    assert lengths.count(1) == 4 and set(lengths) == {0, 1}  # one probe in PROBE_EVERY offers
    assert p.length("b", 4) == 1  # per sequence


def test_acceptance_raises_the_length() -> None:
    p = SpeculationPolicy(row_cost=0.2)
    p.length("a", 8)
    first = p.length("a", 8)
    for _ in range(5):
        p.observe("a", 4, 4)
    assert p.length("a", 8) > first
    p.forget("a")
    assert p.length("a", 8) == 1
