"""The pattern bank: examples in SQLite with faiss nearest neighbours, near-duplicates clustered,
the best of each cluster picked, tenants kept apart, and everything there after a reopen."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ruvllm.learning.bank import PatternBank


def test_clusters_neighbours_and_the_best_of_each(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    a, b = rng.normal(size=64), rng.normal(size=64)
    bank = PatternBank(tmp_path / "bank.sqlite3", duplicate_similarity=0.95)
    first = bank.add("acme", [1, 2], [3], 0.5, a)
    near = bank.add("acme", [1, 2, 9], [4], 1.0, a + 0.01 * rng.normal(size=64))  # a near-duplicate
    other = bank.add("acme", [7], [8], 1.0, b)
    bank.add("globex", [1, 2], [3], 1.0, a)  # another tenant's: never in acme's clusters or searches
    assert near.cluster == first.cluster == first.id and other.cluster == other.id
    (sim, hit), = bank.nearest("acme", b, k=1)
    assert hit.id == other.id and sim > 0.999
    assert [e.id for _, e in bank.nearest("acme", a, k=3)][:2] in ([first.id, near.id], [near.id, first.id])
    best = bank.best_per_cluster("acme")
    assert [e.id for e in best] == [near.id, other.id] and best[0].prompt_ids == [1, 2, 9]
    bank.close()
    again = PatternBank(tmp_path / "bank.sqlite3")
    assert again.count("acme") == 3 and again.count("globex") == 1
    assert again.add("acme", [1], [2], 1.0, a).cluster == first.cluster  # the index rebuilt from SQLite
