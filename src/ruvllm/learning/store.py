"""Recent completions, kept so that feedback on them can be learned from: bounded by count and by
age (both configurable), the oldest dropped first."""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Collection
from dataclasses import dataclass


@dataclass(frozen=True)
class Completion:
    tenant: str
    prompt_ids: list[int]
    output_ids: list[int]
    adapter: str | None  # what produced it
    time: float


class CompletionStore:
    def __init__(self, max_count: int = 10_000, max_age_s: float = 3600.0) -> None:
        self.max_count, self.max_age_s = max_count, max_age_s
        self._items: OrderedDict[str, Completion] = OrderedDict()
        # ids of kept completions their tenant gave feedback on: what it taught, not its everyday text
        # (kept out of EWC++'s Fisher and the KL term); dropped with the completion
        self._taught: set[str] = set()
        self._lock = threading.Lock()

    def add(self, completion_id: str, completion: Completion) -> None:
        with self._lock:
            self._items[completion_id] = completion
            self._items.move_to_end(completion_id)
            while len(self._items) > self.max_count:
                self._taught.discard(self._items.popitem(last=False)[0])

    def mark_taught(self, completion_id: str) -> None:
        with self._lock:
            if completion_id in self._items:
                self._taught.add(completion_id)

    def get(self, completion_id: str, tenant: str) -> Completion | None:
        """The completion, if it is known, not expired and the tenant's (another tenant's is None:
        nobody learns whether it exists)."""
        with self._lock:
            self._expire()
            c = self._items.get(completion_id)
        fresh = c is not None and c.time >= time.time() - self.max_age_s  # whatever order entries came in
        return c if fresh and c.tenant == tenant else None

    def recent(self, tenant: str, n: int, exclude: Collection[str] = ()) -> list[Completion]:
        """The tenant's n most recent completions with an output, none it gave feedback on
        (mark_taught) nor of `exclude`."""
        with self._lock:
            self._expire()
            out = [c for cid, c in reversed(self._items.items())
                   if c.tenant == tenant and cid not in exclude and cid not in self._taught and c.output_ids]
        return out[:n]

    def _expire(self) -> None:
        cutoff = time.time() - self.max_age_s
        while self._items:
            first = next(iter(self._items.values()))
            if first.time >= cutoff:
                break
            self._taught.discard(self._items.popitem(last=False)[0])
