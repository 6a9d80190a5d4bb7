"""Messages between the scheduler, the model runner and the API layers."""

from __future__ import annotations

from dataclasses import dataclass, field

from ruvllm.request import FinishReason, Logprob


@dataclass(slots=True)
class ScheduledSeq:
    request_id: str
    token_ids: list[int]  # tokens whose KV this step computes
    start_position: int  # position of token_ids[0]
    block_table: list[int]
    sample: bool  # the chunk ends at the request's last token: sample its next one
    # (first row, prompt tokens): rows from `first row` on predict these tokens, whose logprobs are
    # wanted (echo scoring). None when the request does not ask for prompt logprobs.
    prompt_logprob_targets: tuple[int, list[int]] | None = None


@dataclass(slots=True)
class SchedulerOutput:
    seqs: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.seqs)

    @property
    def is_empty(self) -> bool:
        return not self.seqs


@dataclass(slots=True)
class ModelRunnerOutput:
    sampled: dict[str, int]  # request id -> next token
    logprobs: dict[str, dict[int, Logprob]]  # request id -> chosen and top-N logprobs
    prompt_logprobs: dict[str, list[dict[int, Logprob]]] = field(default_factory=dict)


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
