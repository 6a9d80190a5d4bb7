"""Rank 0's commands to the other ranks, broadcast as int64 tensors on the command group.

Every model call rank 0 makes is announced first, so the other ranks make the same call with the
same inputs and meet it in the same collectives: a forward pass over a step's tokens (token ids and,
per sequence, its token count, context length and block table: each rank builds the attention
metadata and positions from these itself), logits of given rows of that pass (rank 0 samples, but
the vocabulary-parallel LM head needs every rank), a new KV pool size (after CUDA's profiled
warm-up), and stop.

A command is one broadcast of a fixed-size header that carries the payload too when it fits (a
decode step of a few sequences), else a second broadcast of the rest.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ruvllm.parallel.group import RankGroup

_FORWARD, _LOGITS, _ALLOCATE, _STOP = 1, 2, 3, 4
_HEADER = 256  # int64s: the op, two arguments, the payload's length, then the payload's start
_INLINE = _HEADER - 4


@dataclass(frozen=True)
class Forward:
    input_ids: list[int]
    seqs: list[tuple[int, int, list[int]]]  # per sequence: its tokens in this step, context length, block table

    @property
    def positions(self) -> list[int]:
        return [p for n, ctx, _ in self.seqs for p in range(ctx - n, ctx)]


@dataclass(frozen=True)
class Logits:
    rows: list[int] | None  # rows of the last forward's hidden states; None: every row


@dataclass(frozen=True)
class Allocate:
    num_blocks: int


@dataclass(frozen=True)
class Stop:
    pass


Command = Forward | Logits | Allocate | Stop


class CommandSender:
    """Rank 0's side."""

    def __init__(self, group: RankGroup) -> None:
        self.group = group

    def _send(self, op: int, a: int = 0, b: int = 0, payload: list[int] | None = None) -> None:
        payload = payload or []
        head = [op, a, b, len(payload)] + payload[:_INLINE]
        header = torch.zeros(_HEADER, dtype=torch.int64)
        header[:len(head)] = torch.tensor(head, dtype=torch.int64)
        self.group.broadcast(header)
        if len(payload) > _INLINE:
            self.group.broadcast(torch.tensor(payload[_INLINE:], dtype=torch.int64))

    def forward(self, input_ids: list[int], seqs: list[tuple[int, int, list[int]]]) -> None:
        payload = list(input_ids)
        for n, ctx, table in seqs:
            payload += (n, ctx, len(table))
        for _, _, table in seqs:
            payload += table
        self._send(_FORWARD, len(input_ids), len(seqs), payload)

    def logits(self, rows: list[int] | None) -> None:
        self._send(_LOGITS, int(rows is None), 0, rows)

    def allocate(self, num_blocks: int) -> None:
        self._send(_ALLOCATE, num_blocks)

    def stop(self) -> None:
        self._send(_STOP)


def receive(group: RankGroup) -> Command:
    """The other ranks' side: the next command (blocks while the engine is idle)."""
    header = group.broadcast(torch.empty(_HEADER, dtype=torch.int64)).tolist()
    op, a, b, length = header[:4]
    payload = header[4:4 + min(length, _INLINE)]
    if length > _INLINE:
        payload += group.broadcast(torch.empty(length - _INLINE, dtype=torch.int64)).tolist()
    if op == _FORWARD:
        num_tokens, num_seqs = a, b
        ids = payload[:num_tokens]
        meta = payload[num_tokens:num_tokens + 3 * num_seqs]
        seqs, at = [], num_tokens + 3 * num_seqs
        for i in range(num_seqs):
            n, ctx, blocks = meta[3 * i:3 * i + 3]
            seqs.append((n, ctx, payload[at:at + blocks]))
            at += blocks
        return Forward(ids, seqs)
    if op == _LOGITS:
        return Logits(None if a else payload)
    if op == _ALLOCATE:
        return Allocate(a)
    if op == _STOP:
        return Stop()
    raise RuntimeError(f"unknown tensor-parallel command {op}")
