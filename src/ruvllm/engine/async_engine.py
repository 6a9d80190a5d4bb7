"""Streaming front of the engine: one thread owns the model and loops over step(); asyncio callers
submit requests, receive outputs through per-request queues, and abort by cancelling.

Callers never lock around model calls: the engine thread is the only one that touches the model,
the scheduler and the KV cache; everything crosses over through a command queue.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
from collections.abc import AsyncIterator
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Callable

from ruvllm.config import EngineConfig
from ruvllm.core.engine_core import EngineCore
from ruvllm.errors import EngineShutdownError
from ruvllm.engine.prompts import PromptInput, encode_prompt
from ruvllm.outputs import RequestOutput
from ruvllm.request import Priority
from ruvllm.sampling_params import SamplingParams

log = logging.getLogger(__name__)


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[RequestOutput | BaseException]


class AsyncEngine:
    def __init__(self, config: EngineConfig | None = None, core: EngineCore | None = None) -> None:
        self.core = core or EngineCore(config)
        self.tokenizer = self.core.tokenizer
        self._commands: queue.Queue[tuple[Callable[[], Any], Future[Any] | None]] = queue.Queue()
        self._streams: dict[str, _Stream] = {}
        self._ids = itertools.count()
        self._snapshot = self._take_snapshot()
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="ruvllm-engine", daemon=True)
        self._thread.start()

    # --- caller side -----------------------------------------------------------------------------
    async def generate(self, prompt: PromptInput, params: SamplingParams | None = None,
                       request_id: str | None = None,
                       priority: Priority = Priority.NORMAL) -> AsyncIterator[RequestOutput]:
        """Yields the request's growing output after every step that changes it; the last is finished.

        Leaving the iteration early (break, cancellation, a disconnected client) aborts the request."""
        if self._stopping.is_set():
            raise RuntimeError("engine is shut down")
        params = params or SamplingParams()
        request_id = request_id or f"req-{next(self._ids)}"
        token_ids, text = encode_prompt(self.tokenizer, prompt)
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already in use")
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())
        self._streams[request_id] = stream
        finished = False
        try:
            try:
                await self._call(lambda: self.core.add_request(request_id, token_ids, params, priority, text))
            except Exception:
                finished = True  # the engine refused it: nothing was added, nothing to abort
                raise
            while True:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            self._streams.pop(request_id, None)
            if not finished:
                self._submit(lambda: self.core.abort(request_id))

    async def abort(self, request_id: str) -> None:
        await self._call(lambda: self.core.abort(request_id))

    async def _call(self, fn: Callable[[], Any]) -> Any:
        fut: Future[Any] = Future()
        self._commands.put((fn, fut))
        return await asyncio.wrap_future(fut)

    def _submit(self, fn: Callable[[], Any]) -> None:
        self._commands.put((fn, None))

    def stats(self) -> dict[str, Any]:
        """A snapshot taken on the engine thread now (waits for the current step to end)."""
        fut: Future[dict[str, Any]] = Future()
        self._commands.put((self._take_snapshot, fut))
        return fut.result(timeout=60)

    @property
    def snapshot(self) -> dict[str, Any]:
        """The snapshot the engine thread published after its latest step; never blocks."""
        return self._snapshot

    @property
    def is_alive(self) -> bool:
        return self._thread.is_alive() and not self._stopping.is_set()

    def _take_snapshot(self) -> dict[str, Any]:
        core = self.core
        return {
            "running": core.num_running, "waiting": core.num_waiting,
            "free_blocks": core.num_free_blocks, "total_blocks": core.num_blocks,
            "kv_usage": 1.0 - core.num_free_blocks / core.num_blocks,
            "prefix_queries": core.kv.stats.queries, "prefix_hits": core.kv.stats.hits,
            "preemptions": core.scheduler.num_preemptions,
        }

    def abort_all(self) -> None:
        """Abort every request in flight; their callers get EngineShutdownError."""
        self._submit(self._abort_all)

    def shutdown(self) -> None:
        if not self._thread.is_alive():
            return
        self._stopping.set()
        self._commands.put((lambda: None, None))
        self._thread.join(timeout=30)

    # --- engine thread -----------------------------------------------------------------------------
    def _loop(self) -> None:
        while not self._stopping.is_set():
            block = not self.core.has_unfinished
            try:
                while True:
                    fn, fut = self._commands.get(block=block)
                    block = False
                    self._run_command(fn, fut)
            except queue.Empty:
                pass
            if self._stopping.is_set() or not self.core.has_unfinished:
                continue
            try:
                outputs = self.core.step()
            except Exception as exc:  # a failed step must not kill the loop or strand callers
                log.exception("engine step failed")
                self._fail_all(exc)
                continue
            self._snapshot = self._take_snapshot()
            for out in outputs:
                stream = self._streams.get(out.request_id)
                if stream is not None:
                    stream.loop.call_soon_threadsafe(stream.queue.put_nowait, out)
        # Shut down: abort what is left so every block returns, and tell the callers.
        self._abort_all()

    def _abort_all(self) -> None:
        for rid, stream in list(self._streams.items()):
            self.core.abort(rid)
            stream.loop.call_soon_threadsafe(stream.queue.put_nowait,
                                             EngineShutdownError(f"request {rid} aborted: the engine is shutting down"))

    def _run_command(self, fn: Callable[[], Any], fut: Future[Any] | None) -> None:
        try:
            result = fn()
            self._snapshot = self._take_snapshot()
        except BaseException as exc:
            if fut is not None:
                fut.set_exception(exc)
            return
        if fut is not None:
            fut.set_result(result)

    def _fail_all(self, exc: Exception) -> None:
        for rid, stream in list(self._streams.items()):
            self.core.abort(rid)
            stream.loop.call_soon_threadsafe(stream.queue.put_nowait, RuntimeError(f"engine step failed: {exc}"))
