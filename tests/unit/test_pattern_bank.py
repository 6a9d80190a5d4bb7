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


def test_a_prompts_own_rows_are_embedded_less_what_prompts_share() -> None:
    """PromptEmbedder: the rows between the chat frame's head and tail (never the first), less the
    frame's rows' mean; without a frame, from the second row on, less the neutral state."""
    import torch

    from ruvllm.learning.bank import PromptEmbedder

    framed = PromptEmbedder([1, 2, 3, 99, 4, 5], torch.zeros(2))
    assert framed.span([1, 2, 3, 7, 8, 9, 4, 5]) == (3, 6)
    # an empty message: no rows of its own between the head and tail, so all but the first row
    assert framed.span([1, 2, 3, 4, 5]) == (1, 5)
    assert framed.span([6, 7, 8]) == (1, 3)  # not the frame's: all but the first row
    h = torch.tensor([[100.0, 0.0], [1.0, 1.0], [1.0, 3.0], [5.0, 0.0], [7.0, 0.0], [1.0, 1.0], [1.0, 3.0]])
    # own rows 3-4 (mean [6, 0]) less the frame's rows 1, 2, 5, 6 (mean [1, 2]); row 0 in neither
    assert torch.equal(framed(h, [1, 2, 3, 7, 8, 4, 5]), torch.tensor([5.0, -2.0]))
    bare = PromptEmbedder(None, torch.tensor([1.0, 1.0]))
    assert bare.span([6, 7, 8]) == (1, 3)
    assert torch.equal(bare(h[:3], [6, 7, 8]), torch.tensor([0.0, 1.0]))
