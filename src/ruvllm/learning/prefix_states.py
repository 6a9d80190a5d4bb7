"""The layers below the learned ones, run for a feedback event's (prompt, correction) with the states
of a shared prefix kept (issue 37 item 3, session 23).

Preparing an event on a completion of its own runs the base model below the learned layers over
the whole prompt and correction: ~315 ms of CPU at one thread on the default model (a 40-token chat
prompt and a 12-token correction), six times the update's own cost an event. Every completion of a
chat server starts with the same template header (and often the same system prompt), so the
residual stream entering the learned layers and the K/V of the layers below are kept for the most
recently prepared sequences, and a new sequence that shares a prefix with one of them runs only the
rest of its positions through those layers, attending over the kept K/V. Positions run in chunks
at fixed offsets, so that what a prepared event holds does not depend on what was prepared before
it: bitwise (PrefixStates).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass

import torch

from ruvllm.models.llama import LlamaForCausalLM


@dataclass
class _Kept:
    ids: tuple[int, ...]
    h: torch.Tensor  # [T, H] float32: the residual stream entering layer `first`
    kv: list[tuple[torch.Tensor, torch.Tensor]]  # each layer below `first`: K, V [T, Hkv, D]
    nbytes: int


def _shared(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class PrefixStates:
    """`hidden(ids)`: the residual stream entering layer `first` for a whole sequence ([T, H] float32,
    as `tail.hidden_before` gives it up to float rounding). Positions run in chunks of `CHUNK` at
    fixed offsets (0, CHUNK, 2 CHUNK, ...), each attending over the K/V of those before, so a chunk's
    rows are the same bits whether the chunks before it were run now or kept: a sequence that shares
    at least `min_shared` tokens with a kept one starts at the last chunk boundary inside the shared
    prefix, and its rows are bitwise those of a run from the start (every op but attention is row by
    row, and attention's shapes are the chunk's either way). The most recent sequences are kept up
    to `max_bytes` of states. Thread-safe (the background pass prepares the Fisher's samples beside
    the update's)."""

    CHUNK = 32

    def __init__(self, model: LlamaForCausalLM, first: int, max_bytes: int = 64 << 20, min_shared: int = 8) -> None:
        self.model, self.first, self.max_bytes, self.min_shared = model, first, max_bytes, min_shared
        self._kept: OrderedDict[tuple[int, ...], _Kept] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self.rows_run = 0  # positions run through the layers below, all calls (what the kept prefixes save)

    @torch.inference_mode()
    def hidden(self, token_ids: list[int]) -> torch.Tensor:
        ids = tuple(token_ids)
        with self._lock:
            best, shared = None, 0
            for kept in self._kept.values():
                n = _shared(kept.ids, ids)
                if n > shared:
                    best, shared = kept, n
            if best is not None:
                self._kept.move_to_end(best.ids)
        # (at least one position runs: a sequence kept whole runs its last chunk again)
        start = min(shared, len(ids) - 1) // self.CHUNK * self.CHUNK if shared >= self.min_shared else 0
        hs = [best.h[:start]] if start else []
        kv = [(k[:start], v[:start]) for k, v in best.kv] if start else None
        model = self.model
        for s in range(start, len(ids), self.CHUNK):
            e = min(s + self.CHUNK, len(ids))
            new: list[tuple[torch.Tensor, torch.Tensor]] = []
            run = model.dense_run(model.ops, context=None if kv is None else dict(enumerate(kv)), keep_kv=new)
            x, residual = model.run_layers(model.embed(torch.tensor(ids[s:e], dtype=torch.long)),
                                           torch.arange(s, e), run, 0, self.first)
            hs.append((x if residual is None else residual + x).float())
            kv = [(k.clone(), v.clone()) for k, v in new] if kv is None else \
                [(torch.cat([k0, k]), torch.cat([v0, v])) for (k0, v0), (k, v) in zip(kv, new)]
        h = torch.cat(hs) if len(hs) > 1 else hs[0].clone()
        kv = kv or []
        kept = _Kept(ids, h, kv, h.nbytes + sum(k.nbytes + v.nbytes for k, v in kv))
        with self._lock:
            self.rows_run += len(ids) - start
            if kept.nbytes <= self.max_bytes:
                old = self._kept.pop(ids, None)
                self._bytes += kept.nbytes - (old.nbytes if old is not None else 0)
                self._kept[ids] = kept
                while self._bytes > self.max_bytes:
                    self._bytes -= self._kept.popitem(last=False)[1].nbytes
        return h
