"""Run one API call's engine requests (several prompts, n completions each) and follow them."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from ruvllm.engine.async_engine import AsyncEngine
from ruvllm.errors import AdapterNotFoundError, EngineDeadError, EngineShutdownError, ReplicaLostError, RequestError
from ruvllm.outputs import CompletionOutput, OutputKind, RequestOutput
from ruvllm.request import Priority
from ruvllm.sampling_params import SamplingParams
from ruvllm.server.errors import APIError


RETRY_AFTER_S = 1  # capacity frees as fast as sequences finish: seconds, not minutes


@dataclass
class Admission:
    """Counts the sequences in flight; refuses new ones past running cap + queue length (HTTP 429)."""

    limit: int
    in_flight: int = 0
    _ids: itertools.count = field(default_factory=itertools.count)

    def acquire(self, n: int, param: str | None) -> None:
        """`param`: the field that asked for the `n` sequences (n, or prompt for a list of prompts)."""
        if n > self.limit:  # could never be admitted, even on an idle server: not worth a retry
            raise APIError(400, f"this request asks for {n} sequences, but this server admits at most "
                                f"{self.limit} at once; send fewer prompts or a smaller n", param,
                           "too_many_sequences")
        if self.in_flight + n > self.limit:
            raise APIError(429, f"the server is at capacity ({self.in_flight} sequences in flight, "
                                f"limit {self.limit}); retry later", None, "queue_full",
                           headers={"Retry-After": str(RETRY_AFTER_S)})
        self.in_flight += n

    def release(self, n: int) -> None:
        self.in_flight -= n

    def next_id(self, prefix: str) -> str:
        return f"{prefix}-{next(self._ids)}"


@dataclass
class EnginePrompt:
    token_ids: list[int]
    text: str | None  # as the user sent it, when it was text


def check_context(prompt: EnginePrompt, max_tokens: int | None, max_len: int) -> int:
    """The completion budget of a prompt; 400 (stating both numbers) when it cannot fit."""
    n = len(prompt.token_ids)
    if max_tokens is None:
        if n >= max_len:
            raise APIError(400, f"This model's maximum context length is {max_len} tokens. However, your "
                                f"prompt has {n} tokens, leaving no room for a completion.", "messages",
                           "context_length_exceeded")
        return max_len - n
    if n + max_tokens > max_len:
        raise APIError(400, f"This model's maximum context length is {max_len} tokens. However, you "
                            f"requested {n + max_tokens} tokens ({n} in the prompt, {max_tokens} for the "
                            f"completion). Please reduce the prompt or max_tokens.", "max_tokens",
                       "context_length_exceeded")
    return max_tokens


class Accumulated:
    """One prompt's DELTA outputs gathered into its whole output (pieces are joined once, at the end)."""

    def __init__(self) -> None:
        self.first: RequestOutput | None = None
        self.finished = False
        self._text: dict[int, list[str]] = {}
        self._tokens: dict[int, list[int]] = {}
        self._logprobs: dict[int, list] = {}
        self._finish: dict[int, tuple] = {}

    def add(self, out: RequestOutput) -> None:
        if self.first is None:
            self.first = out
        self.finished = out.finished
        for c in out.outputs:
            self._text.setdefault(c.index, []).append(c.text)
            self._tokens.setdefault(c.index, []).extend(c.token_ids)
            if c.logprobs is not None:
                self._logprobs.setdefault(c.index, []).extend(c.logprobs)
            if c.finish_reason is not None:
                self._finish[c.index] = (c.finish_reason, c.stop_reason)

    @property
    def num_tokens(self) -> int:
        return sum(len(t) for t in self._tokens.values())

    def result(self) -> RequestOutput:
        first = self.first
        assert first is not None
        outs = [CompletionOutput(i, "".join(self._text[i]), self._tokens[i], *self._finish.get(i, (None, None)),
                                 logprobs=self._logprobs.get(i))
                for i in sorted(self._text)]
        return RequestOutput(first.request_id, first.prompt_token_ids, outs, self.finished,
                             first.num_cached_tokens, first.prompt, first.prompt_logprobs, first.queue_time)


# Told, once a prompt's generation has ended however it ended, what it produced: each choice's
# token ids and finish reason ("abort" when it was cut off).
Recorder = Callable[[int, list[tuple[list[int], str]]], None]


async def follow(engine: AsyncEngine, prompts: list[EnginePrompt], params: list[SamplingParams],
                 priority: Priority, request_id: str, lora: str | None = None, record: Recorder | None = None,
                 cache_salt: str | None = None) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Outputs of every prompt as they come (DELTA: only what is new), tagged with the prompt's
    index. Leaving early (client gone, error) cancels the others, and each cancelled stream aborts
    its engine request."""
    queue: asyncio.Queue[tuple[int, RequestOutput] | BaseException | None] = asyncio.Queue()

    async def pump(i: int) -> None:
        tokens: dict[int, list[int]] = {}
        reasons: dict[int, str] = {}
        try:
            async for out in engine.generate(prompts[i].token_ids, params[i], f"{request_id}-{i}", priority,
                                             OutputKind.DELTA, lora, cache_salt):
                for c in out.outputs if record is not None else ():
                    tokens.setdefault(c.index, []).extend(c.token_ids)
                    if c.finish_reason is not None:
                        reasons[c.index] = c.finish_reason.value
                await queue.put((i, out))
            await queue.put(None)
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # forwarded to the caller, which maps it to an HTTP error
            await queue.put(exc)
        finally:
            if record is not None and tokens:
                record(i, [(tokens[k], reasons.get(k, "abort")) for k in sorted(tokens)])

    tasks = [asyncio.create_task(pump(i)) for i in range(len(prompts))]
    remaining = len(tasks)
    try:
        while remaining:
            item = await queue.get()
            if item is None:
                remaining -= 1
                continue
            if isinstance(item, BaseException):
                raise api_error(item) from item
            yield item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def api_error(exc: BaseException) -> BaseException:
    """What an engine-side failure means to the HTTP client."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, EngineShutdownError):
        return APIError(503, str(exc), None, "shutting_down")
    if isinstance(exc, ReplicaLostError):  # the others serve on: a retry is answered
        return APIError(503, str(exc), None, "replica_failed")
    if isinstance(exc, EngineDeadError):
        return APIError(500, str(exc), None, "engine_failed")
    if isinstance(exc, AdapterNotFoundError):  # unloaded between the check and the start
        return APIError(404, str(exc), "model", "model_not_found")
    if isinstance(exc, RequestError):
        return APIError(400, str(exc), exc.param, "invalid_value")
    if isinstance(exc, ValueError):
        return APIError(400, str(exc), None, "invalid_value")
    return exc
