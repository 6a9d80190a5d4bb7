"""CUDA graphs of the forward pass for decode-only steps, captured at start-up at bucketed batch sizes.

A graph covers the forward pass and the LM head. A decode step of a small model is a few hundred tiny kernels; launched one by one from Python the
GPU mostly waits. A graph replays them all in one launch. A step of n decodes runs the graph of the
smallest bucket >= n; the extra rows are padding that reads one key of a scratch block and writes
its own key there, so it touches no sequence's cache. Each row's arithmetic is the same in every
bucket and in the eager path (the attention kernel is row-independent), so graphs change no output.

Launched ahead (`async_scheduling`). Between two decode steps the host turns tokens into outputs,
schedules, and builds the next inputs, and without more the GPU waits for it: 0.9 ms of a 7.2 ms
Llama-3-8B step and 0.55 ms of a 1.9 ms Llama-3.2-1B one on an H100 (docs/gpu.md). So once a graph
step's tokens are sampled on the device, and before they are copied to the host, the same graph is
replayed for the step that most likely comes next: the same sequences, each one token further, in
the same KV block (its table unchanged), the sampled tokens copied into the input ids on the device.
The host's work then overlaps that replay. The next `run` uses its logits only if its schedule is
exactly what was launched (the same sequences in the same order, at those positions, with those
tokens and tables, and no KV blocks moved or loaded in between); otherwise it runs its own replay.
The forward pass of a graph reads nothing but its inputs, so the logits used are bitwise those
the step would have computed. A launch that is not used wrote keys and values only at each
sequence's next position, inside a block the sequence alone holds (not yet full, so never a cached
block), which the step that computes that position overwrites before anything reads it.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ruvllm.attention.metadata import AttentionMetadata
from ruvllm.outputs import SchedulerOutput

if TYPE_CHECKING:
    from ruvllm.worker.model_runner import ModelRunner

log = logging.getLogger(__name__)


def bucket_sizes(max_batch: int) -> list[int]:
    """1, 2, 4, 8, then every 8 up to 64, then every 16, up to (and including) max_batch."""
    sizes = [b for b in (1, 2, 4) if b < max_batch]
    b = 8
    while b < max_batch:
        sizes.append(b)
        b += 8 if b < 64 else 16
    return sizes + [max_batch]


@dataclass
class GraphStep:
    """What a replay computed: its sequences, their positions and block tables; for a step
    launched ahead, also the tokens it took as input (known on the host once copied)."""

    request_ids: list[str]
    positions: list[int]
    tables: list[list[int]]
    tokens: list[int] | None = None


class DecodeGraphs:
    def __init__(self, runner: ModelRunner, max_batch: int, max_model_len: int, ahead: bool = True) -> None:
        self.runner = runner
        self.ahead = ahead
        self.max_model_len = max_model_len
        self._last: GraphStep | None = None  # the replay whose logits the sampler is reading
        self._ahead: GraphStep | None = None  # the replay launched ahead, until the next run
        self.ahead_used = 0  # steps that used logits launched ahead (a count for tests and benchmarks)
        self.sizes = bucket_sizes(max_batch)
        self.max_batch = max_batch
        bs = runner.block_size
        self.max_blocks = (max_model_len + bs - 1) // bs
        dev = runner.device
        # Inputs the graphs read, refilled before each replay: ids, positions, slots, context lengths.
        self.fields = torch.zeros(4, max_batch, dtype=torch.long, device=dev)
        self.tables = torch.zeros(max_batch, self.max_blocks, dtype=torch.int32, device=dev)
        self.arange = torch.arange(max_batch, dtype=torch.long, device=dev)
        self.ones = torch.ones(max_batch, dtype=torch.long, device=dev)
        self.host_fields = torch.zeros(4, max_batch, dtype=torch.long, pin_memory=True)
        self.host_tables = torch.zeros(max_batch, self.max_blocks, dtype=torch.int32, pin_memory=True)
        self.host_tokens = torch.zeros(max_batch, dtype=torch.long, pin_memory=True)
        self.tokens_copied = torch.cuda.Event()
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool = None
        start = time.perf_counter()
        self.reset_inputs()
        for b in reversed(self.sizes):  # largest first, so smaller graphs reuse its memory pool
            self._capture(b)
        torch.cuda.synchronize(dev)
        log.info("CUDA graphs for decode batches %s captured in %.1f s", self.sizes, time.perf_counter() - start)

    def _meta(self, b: int) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.fields[2, :b], decode_rows=None, decode_block_tables=None, decode_mask=None,
            prefills=[], block_size=self.runner.block_size, block_tables=self.tables[:b],
            row_seq=self.arange[:b], row_ctx=self.fields[3, :b],
            tile_seq=self.arange[:b], tile_start=self.arange[:b], tile_len=self.ones[:b], num_tiles=b)

    def reset_inputs(self) -> None:
        """Every row a padding row (a replay then writes only the scratch block)."""
        self.discard_ahead()
        self._pad_rows(0, self.max_batch)
        self.fields.copy_(self.host_fields)
        self.tables.copy_(self.host_tables)

    @torch.inference_mode()
    def _capture(self, b: int) -> None:
        r = self.runner
        meta = self._meta(b)

        def forward() -> torch.Tensor:
            hidden = r.model(self.fields[0, :b], self.fields[1, :b], r.kv_views, meta, r.attn)
            return r.model.compute_logits(hidden)

        side = torch.cuda.Stream(device=r.device)
        side.wait_stream(torch.cuda.current_stream(r.device))
        with torch.cuda.stream(side):  # warm-up: Triton compiles, cuBLAS picks its kernels
            forward()
        torch.cuda.current_stream(r.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = forward()
        self.pool = graph.pool()
        self.graphs[b] = (graph, out)

    def run(self, so: SchedulerOutput) -> torch.Tensor | None:
        """The step's logits [n, V] (model dtype) from a graph, or None when no graph fits the step:
        it fits when every sequence decodes one token, samples, and wants no prompt logprobs."""
        seqs = so.seqs
        n = len(seqs)
        ahead = self._ahead
        self.discard_ahead()
        if n > self.max_batch or any(len(s.token_ids) != 1 or not s.sample or s.prompt_logprob_targets is not None
                                     for s in seqs):
            return None
        b = self._bucket(n)
        r = self.runner
        bs = r.block_size
        if ahead is not None and not so.kv_moves and not so.kv_loads and self._is(ahead, seqs):
            self.ahead_used += 1
            self._last = ahead
            return self.graphs[b][1][:n]
        fields, tables = self.host_fields, self.host_tables
        ids, pos, slots, ctx, rows = [], [], [], [], []
        for s in seqs:
            p = s.start_position
            ids.append(s.token_ids[0])
            pos.append(p)
            slots.append(s.block_table[p // bs] * bs + p % bs)
            ctx.append(p + 1)
            rows.append(s.block_table[:p // bs + 1])
        width = max(len(t) for t in rows)
        # One tensor for all rows (per-row assignments cost microseconds each at 256 rows).
        tables[:n, :width] = torch.tensor([t + [0] * (width - len(t)) for t in rows], dtype=torch.int32)
        fields[:, :n] = torch.tensor([ids, pos, slots, ctx], dtype=torch.long)
        self._pad_rows(n, b)
        # The pinned buffers are rewritten only at the next step, after sampling has synchronized
        # with this step's copies.
        self.fields.copy_(fields, non_blocking=True)
        self.tables[:b].copy_(tables[:b], non_blocking=True)
        graph, out = self.graphs[b]
        graph.replay()
        self._last = GraphStep([s.request_id for s in seqs], pos, rows)
        return out[:n]

    def _bucket(self, n: int) -> int:
        """The smallest captured batch that holds n rows."""
        return next(size for size in self.sizes if size >= n)

    def _is(self, step: GraphStep, seqs: list) -> bool:
        """Whether these scheduled sequences are exactly what `step` computed."""
        bs = self.runner.block_size
        return (step.tokens is not None and len(seqs) == len(step.request_ids)
                and all(s.request_id == rid and s.start_position == p and s.token_ids[0] == t
                        and s.block_table[:p // bs + 1] == table
                        for s, rid, p, t, table
                        in zip(seqs, step.request_ids, step.positions, step.tokens, step.tables)))

    def discard_ahead(self) -> None:
        """Forget the replays in flight (a step that runs without a graph calls this)."""
        self._ahead = self._last = None

    def tokens_then_ahead(self, chosen: torch.Tensor) -> list[int]:
        """The sampler's tokens [n] (on the device) as a list, with the next step launched ahead
        between their copy to the host and the wait for it."""
        n = chosen.shape[0]
        host = self.host_tokens[:n]
        host.copy_(chosen, non_blocking=True)
        self.tokens_copied.record()
        launched = self._launch_ahead(chosen)
        self.tokens_copied.synchronize()
        tokens = host.tolist()
        if launched is not None:
            launched.tokens = tokens
        return tokens

    def _launch_ahead(self, chosen: torch.Tensor) -> GraphStep | None:
        last, bs = self._last, self.runner.block_size
        self._last = None
        if not self.ahead or last is None or len(last.positions) != chosen.shape[0]:
            return None
        # Only where every sequence's next token falls in the block it writes now: its table (on the
        # device already) is then unchanged, and no block is allocated for a step that may not come.
        if any((p + 1) % bs == 0 or p + 1 >= self.max_model_len for p in last.positions):
            return None
        n = len(last.positions)
        self.fields[0, :n].copy_(chosen)
        self.fields[1:, :n] += 1  # positions, slots and context lengths: each one further
        self.graphs[self._bucket(n)][0].replay()
        self._ahead = GraphStep(last.request_ids, [p + 1 for p in last.positions], last.tables)
        return self._ahead

    def _pad_rows(self, start: int, end: int) -> None:
        """Rows [start, end) of the host buffers: token 0 at position 0 in the scratch block."""
        r = self.runner
        f = self.host_fields
        f[0:2, start:end] = 0
        f[2, start:end] = r.scratch_block * r.block_size
        f[3, start:end] = 1
        self.host_tables[start:end, 0] = r.scratch_block
