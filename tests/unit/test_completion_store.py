"""The completions kept for feedback: bounded by count and by age, and only the owner's visible."""

from __future__ import annotations

import time

from ruvllm.learning.store import Completion, CompletionStore


def _c(tenant: str, age: float = 0.0) -> Completion:
    return Completion(tenant, [1, 2], [3], None, time.time() - age)


def test_count_age_and_owner() -> None:
    store = CompletionStore(max_count=2, max_age_s=60)
    store.add("a", _c("acme"))
    store.add("b", _c("acme"))
    store.add("c", _c("acme"))
    assert store.get("a", "acme") is None and store.get("c", "acme") is not None  # the oldest dropped
    assert store.get("c", "globex") is None  # another tenant's: as if unknown
    store.add("old", _c("acme", age=120))
    assert store.get("old", "acme") is None  # expired
    assert [c.output_ids for c in store.recent("acme", 5, exclude="c")] == [[3]]
