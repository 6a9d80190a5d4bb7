"""Messages between the scheduler and the worker (in the core's process), and the front's outputs."""

from __future__ import annotations

import enum
import struct
from dataclasses import dataclass, field
from typing import Any

from ruvllm.core.disk_index import DiskBlock, DiskLoad
from ruvllm.messages import CoreRequest
from ruvllm.request import FinishReason, Logprob


@dataclass(slots=True)
class ScheduledSeq:
    request_id: str
    token_ids: list[int]  # tokens whose KV this step computes
    start_position: int  # position of token_ids[0]
    block_table: list[int]  # of KV group 0 (kv_groups.py: the full-attention layers)
    sample: bool  # the chunk ends at the request's last token: sample its next one
    # (first row, prompt tokens): rows from `first row` on predict these tokens, whose logprobs are
    # wanted (echo scoring). None when the request does not ask for prompt logprobs.
    prompt_logprob_targets: tuple[int, list[int]] | None = None
    adapter: str | None = None  # the LoRA adapter the sequence runs with (None: the base model)
    # Adapters stacked on it, their deltas added after its own in this order (its tenant's learned micro-LoRA)
    stacked: tuple[str, ...] = ()
    # An X-LoRA sequence's scaling-pass block table (None for every other sequence)
    scaling_block_table: list[int] | None = None
    # Speculative decoding: a decoding sequence may have up to this many proposed tokens scored
    # after its token in this step (its blocks have room for them); the worker's proposer fills them.
    num_lookahead: int = 0
    # The block tables of KV groups 1.. (a model with sliding-window layers; empty for one group)
    group_block_tables: list[list[int]] = field(default_factory=list)
    # An embedding request's chunk: its rows' hidden states are pooled (worker/pooling.py), never
    # sampled; the chunk with `sample` set (the last) yields the vector.
    pool: bool = False


@dataclass(slots=True)
class SchedulerOutput:
    """One step's whole instruction to the worker: it never sees a scheduler object.

    Block tables are sent whole each step (not as appended ids) because the two-tier cache rewrites
    them: a block that moves cold changes id in the middle of a table."""

    seqs: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)
    # Sequences scheduled for the first time: the worker sets up their sampling state from these.
    new_requests: list[CoreRequest] = field(default_factory=list)
    # The compiled grammars of new_requests that have one (structured outputs), by request id.
    grammars: dict[str, Any] = field(default_factory=dict)
    # Sequences that ended since the last step: the worker drops their state.
    finished_ids: list[str] = field(default_factory=list)
    # (hot block, cold block) pairs to quantize-copy before this step's forward pass.
    kv_moves: list[tuple[int, int]] = field(default_factory=list)
    # The disk tier (core/disk_index.py). (block id, its disk name): cached blocks this step's
    # allocations evicted, to be copied out and written to disk before anything writes the pool;
    # then the loads: blocks read from disk, copied in before the forward pass.
    kv_spills: list[tuple[int, DiskBlock]] = field(default_factory=list)
    kv_loads: list[DiskLoad] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.seqs)

    @property
    def is_empty(self) -> bool:
        return not self.seqs

    @property
    def has_work(self) -> bool:
        """Anything for the worker to do (a step with no sequence may still move blocks or drop state)."""
        return bool(self.seqs or self.kv_moves or self.finished_ids or self.kv_spills)


@dataclass(slots=True)
class ModelRunnerOutput:
    # request id -> its next tokens: one, or with speculation the accepted proposals and one more
    sampled: dict[str, list[int]]
    logprobs: dict[str, list[dict[int, Logprob]]]  # request id -> per sampled token: chosen and top-N
    prompt_logprobs: dict[str, list[dict[int, Logprob]]] = field(default_factory=dict)
    num_proposed: dict[str, int] = field(default_factory=dict)  # request id -> tokens its proposer guessed
    # request id -> its pooled, L2-normalized vector (little-endian float32): embedding requests
    # whose last chunk ran this step
    pooled: dict[str, bytes] = field(default_factory=dict)


class OutputKind(enum.Enum):
    """What a caller of generate() receives after each step."""

    CUMULATIVE = "cumulative"  # everything so far (the offline default: readable, O(n^2) over a stream)
    DELTA = "delta"  # only what is new since the previous output (streaming servers)
    FINAL_ONLY = "final_only"  # one output, when the request has finished


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None
    logprobs: list[dict[int, Logprob]] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    prompt: str | None = None
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None  # first entry None
    queue_time: float | None = None  # seconds from arrival to first scheduled


@dataclass
class EmbeddingOutput:
    """One input's embedding: its final hidden states pooled (EngineInfo.pooling, or the request's)
    and L2-normalized, as float32 values."""

    request_id: str
    prompt_token_ids: list[int]
    embedding: list[float]
    num_cached_tokens: int = 0  # prompt tokens whose K/V came from the prefix cache (last-token pooling)
    queue_time: float | None = None  # seconds from arrival to first scheduled

    @classmethod
    def from_bytes(cls, request_id: str, prompt_token_ids: list[int], data: bytes, num_cached_tokens: int = 0,
                   queue_time: float | None = None) -> EmbeddingOutput:
        """From the core's little-endian float32 bytes (CoreOutput.embedding)."""
        values = list(struct.unpack(f"<{len(data) // 4}f", data))
        return cls(request_id, list(prompt_token_ids), values, num_cached_tokens, queue_time)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)
