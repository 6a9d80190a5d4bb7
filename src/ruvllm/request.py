"""A request's life inside the engine: its tokens, how many are computed, its blocks, its status."""

from __future__ import annotations

import enum
import itertools
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ruvllm.sampling_params import SamplingParams

if TYPE_CHECKING:
    from ruvllm.core.adapters import AdapterRun


class Priority(enum.IntEnum):
    """Higher value is served first and preempted last."""

    LOW = 0
    NORMAL = 1
    HIGH = 2
    CRITICAL = 3


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS, stop token or stop string
    LENGTH = "length"  # max_tokens or context length
    ABORT = "abort"


@dataclass
class Logprob:
    token_id: int
    logprob: float
    rank: int


def slice_tokens(prompt: list[int], output: list[int], start: int, end: int) -> list[int]:
    """(prompt + output)[start:end] without building the whole list."""
    n = len(prompt)
    if end <= n:
        return prompt[start:end]
    if start >= n:
        return output[start - n:end - n]
    return prompt[start:] + output[:end - n]


def scaling_key(request_id: str) -> str:
    """The KV block table of a request's scaling pass (X-LoRA), beside its own."""
    return request_id + "\x00scaling"


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    eos_token_ids: tuple[int, ...] = ()
    priority: Priority = Priority.NORMAL
    arrival: int = 0  # monotonic sequence number: first come, first served within a priority
    # The request this one shares a prompt with (n > 1): it waits until the sibling's prompt is cached.
    prompt_sibling: Request | None = None
    max_total_tokens: int = 1 << 30  # context length cap
    adapter: AdapterRun | None = None  # its LoRA adapter (None: the base model)
    stacked: tuple[AdapterRun, ...] = ()  # adapters stacked on it, their deltas added after its own in order
    # The CoreRequest's cache_salt (a tenant's): requests with different salts share no cached block.
    salt: str | None = None
    # Structured outputs: the future of its compiled grammar (the core's GrammarCompiler); the
    # scheduler admits it once the core has seen the compile succeed (grammar_ready).
    grammar: Any = None
    grammar_ready: bool = False
    # An embedding request's pooling ("last" or "mean"; None: generation): computed, pooled, finished.
    pooling: str | None = None

    output_token_ids: list[int] = field(default_factory=list)
    num_new_tokens: int = 0  # output tokens the last step added (more than one with speculation)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served by the prefix cache on admission
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None
    num_preemptions: int = 0
    # Prompt tokens scored so far (prompt logprobs): one per prompt token from the second on (the
    # first has no context to be scored in); a preempted request does not score them twice.
    num_prompt_logprobs: int = 0
    arrival_time: float = field(default_factory=time.monotonic)
    first_scheduled_time: float | None = None
    queue_time_sent: bool = False

    @property
    def cache_salt(self) -> object:
        """Mixed into the first block's prefix-cache hash: blocks computed under one adapter (one load
        of it: a name loaded again is another adapter) are never a hit for another, or for the base."""
        if self.stacked:  # a stack is its own adapter: blocks computed under it are a hit for it alone
            assert self.adapter is not None
            return _salt((self.adapter.load_id, *(r.load_id for r in self.stacked)), self.salt)
        return _salt(self.adapter.load_id if self.adapter is not None else None, self.salt)

    @property
    def scaling_pass(self) -> bool:
        """An X-LoRA request: a scaling pass (the base model) runs before its real pass."""
        return self.adapter is not None and self.adapter.scaling_pass

    @property
    def kv_streams(self) -> list[tuple[str, object]]:
        """(key, prefix-cache salt) of each KV block table the request holds: its own, and for an
        X-LoRA request the scaling pass's, salted as the base model's requests with its own salt are
        (so it shares their blocks)."""
        own = (self.request_id, self.cache_salt)
        if not self.scaling_pass:
            return [own]
        return [own, (scaling_key(self.request_id), _salt(None, self.salt))]

    @property
    def adapter_runs(self) -> tuple[AdapterRun, ...]:
        """Every adapter it holds, in the order their deltas are added."""
        return (self.adapter, *self.stacked) if self.adapter is not None else ()

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def pools_every_row(self) -> bool:
        """Mean pooling reads every prompt row's hidden state: none may come from the prefix cache."""
        return self.pooling == "mean"

    def token_slice(self, start: int, end: int) -> list[int]:
        """all_token_ids[start:end] without building the whole list (called for every request every step)."""
        return slice_tokens(self.prompt_token_ids, self.output_token_ids, start, end)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def sort_key(self) -> tuple[int, int]:
        """Admission order: higher priority first, then earlier arrival."""
        return (-int(self.priority), self.arrival)


class ArrivalCounter:
    """Hands out arrival numbers; one per engine, so there is no module-level state."""

    def __init__(self) -> None:
        self._it = itertools.count()

    def next(self) -> int:
        return next(self._it)


def _salt(adapter_load: int | tuple[int, ...] | None, salt: str | None) -> object:
    """The prefix cache's salt: an adapter's load and a request's own salt (None when neither
    applies: the base model's blocks, shared by every unsalted request)."""
    if adapter_load is None and salt is None:
        return None
    return (None if adapter_load is None else ("lora", adapter_load), salt)
