"""Run one API call's engine requests (several prompts, n completions each) and follow them."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from ruvllm.engine.async_engine import AsyncEngine
from ruvllm.errors import EngineShutdownError, RequestError
from ruvllm.outputs import RequestOutput
from ruvllm.request import Priority
from ruvllm.sampling_params import SamplingParams
from ruvllm.server.errors import APIError


@dataclass
class Admission:
    """Counts the sequences in flight; refuses new ones past running cap + queue length (HTTP 429)."""

    limit: int
    in_flight: int = 0
    _ids: itertools.count = field(default_factory=itertools.count)

    def acquire(self, n: int) -> None:
        if self.in_flight + n > self.limit:
            raise APIError(429, f"the server is at capacity ({self.in_flight} sequences in flight, "
                                f"limit {self.limit}); retry later", None, "queue_full")
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


async def follow(engine: AsyncEngine, prompts: list[EnginePrompt], params: list[SamplingParams],
                 priority: Priority, request_id: str) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Outputs of every prompt as they come, tagged with the prompt's index. Leaving early (client
    gone, error) cancels the others, and each cancelled stream aborts its engine request."""
    queue: asyncio.Queue[tuple[int, RequestOutput] | BaseException | None] = asyncio.Queue()

    async def pump(i: int) -> None:
        try:
            async for out in engine.generate(prompts[i].token_ids, params[i], f"{request_id}-{i}", priority):
                await queue.put((i, out))
            await queue.put(None)
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # forwarded to the caller, which maps it to an HTTP error
            await queue.put(exc)

    tasks = [asyncio.create_task(pump(i)) for i in range(len(prompts))]
    remaining = len(tasks)
    try:
        while remaining:
            item = await queue.get()
            if item is None:
                remaining -= 1
                continue
            if isinstance(item, EngineShutdownError):
                raise APIError(503, str(item), None, "shutting_down")
            if isinstance(item, RequestError):
                raise APIError(400, str(item), "prompt")
            if isinstance(item, ValueError):
                raise APIError(400, str(item))
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
