"""The sampled softmax's uniformly drawn candidates, made ahead of the steps that use them (issue 37
item 1, session 18).

A step's drawn candidates (`InstantConfig.candidates` tokens of the vocabulary, uniformly, with
repeats) do not depend on its event: only which of them are also the event's exact candidates does,
and that is settled in the step (instant.py masks those). Their LM-head rows, gathered from the
float32 table, cost 1.2-2.0 ms of a step when the table is cold in the caches (latency-bound:
docs/learning.md). So the background pass draws and gathers the next steps' candidates after an
update (`fill`), and a step takes a ready batch (`take`), reading one contiguous block where it
gathered scattered rows.

What is learned is unchanged: every batch is a fresh draw from the one generator, each taken once,
and in the generator's order (the draw and its gather happen under the pool's lock, so a step that
arrives while a batch is being made waits for that batch rather than drawing past it): the k-th
step's candidates are the k-th draw, as when each step drew its own.
"""

from __future__ import annotations

import threading
from collections import deque
from typing import NamedTuple

import torch


class Drawn(NamedTuple):
    tokens: torch.Tensor  # [n] token ids, uniform over the vocabulary, repeats kept
    rows: torch.Tensor  # [n, H] their head rows, gathered (a contiguous copy)


class CandidatePool:
    """Batches of drawn candidates over `head`'s rows, `keep` of them made ahead at most."""

    def __init__(self, head: torch.Tensor, seed: int, keep: int) -> None:
        self._head, self.keep = head, keep
        self._gen = torch.Generator().manual_seed(seed)
        self._ready: deque[Drawn] = deque()
        # Guards the generator and the ready batches together: a batch is drawn, gathered and queued
        # (or handed out) under it, so no step sees a half-made batch, none is taken twice, and the
        # batches go out in the order drawn.
        self._lock = threading.Lock()

    def take(self, n: int) -> Drawn:
        """The next batch of `n` drawn candidates: a ready one, else drawn and gathered now. Ready
        batches of another size (the config changed) are dropped."""
        with self._lock:
            while self._ready and len(self._ready[0].tokens) != n:
                self._ready.popleft()
            return self._ready.popleft() if self._ready else self._draw(n)

    def fill(self, n: int) -> int:
        """Make batches of `n` until `keep` are ready (the background pass's, off the feedback's
        path). A batch at a time under the lock, so a step waits for one gather at most. Returns how
        many were made."""
        made = 0
        while True:
            with self._lock:
                if len(self._ready) >= self.keep:
                    return made
                self._ready.append(self._draw(n))
            made += 1

    def ready(self) -> int:
        with self._lock:
            return len(self._ready)

    def _draw(self, n: int) -> Drawn:
        tokens = torch.randint(0, self._head.shape[0], (n,), generator=self._gen)
        # (index_select: a row copy each, ~6x faster than advanced indexing's generic gather here)
        return Drawn(tokens, self._head.index_select(0, tokens))
