"""Embeddings: an embedding request's final hidden states pooled into one L2-normalized vector.

A long input is computed in chunks over several steps (chunked prefill), each chunk beside whatever
else the step runs. The vector must not depend on where those chunks were cut (that depends on the
other requests in the step): an input gets the same vector alone as in any batch, bit for bit.

- "last": the last row of the last chunk; nothing is kept between chunks.
- "mean": rows are summed in fixed groups of GROUP consecutive positions (position p falls in
  group p // GROUP, wherever the chunks were cut), each group with one reduction over a [GROUP, H]
  tensor, and the group sums added up in position order. A chunk that ends inside a group leaves
  that group's rows pending until the next chunk completes it. So the additions, and their order,
  are the same for every chunking; a running sum over each chunk's rows would round differently
  for each cut.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

GROUP = 16  # positions summed by one reduction in mean pooling


@dataclass
class _Pooling:
    method: str  # "last" or "mean"
    total: torch.Tensor | None = None  # mean: the sum of every complete group so far (float32)
    pending: torch.Tensor | None = None  # mean: rows of the group the last chunk ended in
    rows: int = 0  # mean: rows seen (the next chunk starts at this position)

    def reset(self) -> None:
        self.total = self.pending = None
        self.rows = 0


class Pooler:
    """Each embedding request's pooling state from its first chunk to its last (the worker's)."""

    def __init__(self) -> None:
        self._states: dict[str, _Pooling] = {}

    def start(self, request_id: str, method: str) -> None:
        if method not in ("last", "mean"):
            raise ValueError(f"unknown pooling {method!r}: last or mean")
        self._states[request_id] = _Pooling(method)

    def forget(self, request_id: str) -> None:
        self._states.pop(request_id, None)

    def preempted(self, request_id: str) -> None:
        """Its blocks were freed: it is computed again from its first token."""
        state = self._states.get(request_id)
        if state is not None:
            state.reset()

    def add(self, request_id: str, start: int, rows: torch.Tensor, last: bool) -> bytes | None:
        """A chunk's final hidden states [n, H] (positions start..start+n-1); on the request's last
        chunk, its vector as little-endian float32 bytes."""
        state = self._states[request_id]
        if state.method == "last":
            return _normalized(rows[-1].float()) if last else None
        if start != state.rows:  # (mean pooling takes no prefix-cache hits: every chunk follows the last)
            raise RuntimeError(f"pooling {request_id}: a chunk at {start} after {state.rows} rows")
        state.rows = start + rows.shape[0]
        rows = rows.float()
        if state.pending is not None:  # the rest of the group the last chunk ended in comes first
            rows = torch.cat([state.pending, rows])
        whole = rows.shape[0] // GROUP * GROUP
        for g in range(0, whole, GROUP):
            part = rows[g:g + GROUP].contiguous().sum(dim=0)
            state.total = part if state.total is None else state.total + part
        state.pending = rows[whole:].clone() if whole < rows.shape[0] else None
        if not last:
            return None
        total = state.total
        if state.pending is not None:
            tail = state.pending.contiguous().sum(dim=0)
            total = tail if total is None else total + tail
        assert total is not None
        return _normalized(total / state.rows)


def _normalized(v: torch.Tensor) -> bytes:
    """v / |v| as little-endian float32 (a zero vector stays zero)."""
    norm = torch.linalg.vector_norm(v)
    if norm > 0:
        v = v / norm
    return v.detach().to("cpu", torch.float32).numpy().astype("<f4").tobytes()
