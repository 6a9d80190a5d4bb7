"""Streaming front of the engine: one thread owns the model and loops over step(); asyncio callers
submit requests, receive outputs through per-request queues, and abort by cancelling.

Callers never lock around model calls: the engine thread is the only one that touches the model,
the scheduler and the KV cache; everything crosses over through a command queue.

No caller can hurt the loop: a caller that gives up (a dropped connection cancels its task) at any
point, before its request was taken, while it waits or streams, or after it finished, leaves a
command that is skipped or an abort that frees what the request held. If the loop fails anyway,
it fails loudly: every open request and every later call gets EngineDeadError, `is_alive` turns
false, and the failure callbacks run (the server exits non-zero so a supervisor restarts it).
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
from ruvllm.errors import EngineDeadError, EngineShutdownError
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
        # Guards the hand-off into the command queue against the engine closing: once `_closed` is
        # set, no command is queued again, so none can wait for a loop that is gone.
        self._lock = threading.Lock()
        self._closed: EngineDeadError | EngineShutdownError | None = None
        self._failure_callbacks: list[Callable[[EngineDeadError], None]] = []
        self._thread = threading.Thread(target=self._loop, name="ruvllm-engine", daemon=True)
        self._thread.start()

    # --- caller side -----------------------------------------------------------------------------
    async def generate(self, prompt: PromptInput, params: SamplingParams | None = None,
                       request_id: str | None = None,
                       priority: Priority = Priority.NORMAL) -> AsyncIterator[RequestOutput]:
        """Yields the request's growing output after every step that changes it; the last is finished.

        Leaving the iteration early (break, cancellation, a disconnected client) aborts the request."""
        if self._closed is not None:
            raise self._closed
        if self._stopping.is_set():
            raise EngineShutdownError("engine is shut down")
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
                # Queued behind the add (commands run in order), so it also undoes an add that a
                # cancelled caller never saw complete.
                self._submit(lambda: self.core.abort(request_id))

    async def abort(self, request_id: str) -> None:
        await self._call(lambda: self.core.abort(request_id))

    async def _call(self, fn: Callable[[], Any]) -> Any:
        fut: Future[Any] = Future()
        self._put(fn, fut)
        return await asyncio.wrap_future(fut)

    def _put(self, fn: Callable[[], Any], fut: Future[Any] | None) -> None:
        with self._lock:
            if self._closed is not None:
                raise self._closed
            self._commands.put((fn, fut))

    def _submit(self, fn: Callable[[], Any]) -> None:
        """Fire and forget; once the engine is closed there is nothing left to do it to."""
        try:
            self._put(fn, None)
        except (EngineDeadError, EngineShutdownError):
            pass

    def stats(self) -> dict[str, Any]:
        """A snapshot taken on the engine thread now (waits for the current step to end)."""
        fut: Future[dict[str, Any]] = Future()
        self._put(self._take_snapshot, fut)
        return fut.result(timeout=60)

    @property
    def snapshot(self) -> dict[str, Any]:
        """The snapshot the engine thread published after its latest step; never blocks."""
        return self._snapshot

    @property
    def is_alive(self) -> bool:
        return self._thread.is_alive() and not self._stopping.is_set() and self._closed is None

    @property
    def failure(self) -> EngineDeadError | None:
        """Why the engine loop stopped, when it failed (None while it runs, or after a clean shutdown)."""
        return self._closed if isinstance(self._closed, EngineDeadError) else None

    def on_failure(self, callback: Callable[[EngineDeadError], None]) -> None:
        """Call `callback` (on the engine thread) if the loop fails; at once if it already has."""
        self._failure_callbacks.append(callback)
        if self.failure is not None:
            callback(self.failure)

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
        self._submit(lambda: None)  # wakes the loop if it waits for a command
        self._thread.join(timeout=30)

    # --- engine thread -----------------------------------------------------------------------------
    def _loop(self) -> None:
        try:
            while not self._stopping.is_set():
                self._run_commands(block=not self.core.has_unfinished)
                if self._stopping.is_set() or not self.core.has_unfinished:
                    continue
                # A failed step is a failed engine: its scheduler and cache may be half-updated, so
                # serving on would risk wrong output. Requests cannot cause one (they are checked
                # at admission), so what remains is a bug or a broken device: say so and stop.
                outputs = self.core.step()
                self._snapshot = self._take_snapshot()
                for out in outputs:
                    stream = self._streams.get(out.request_id)
                    if stream is not None:
                        _deliver(stream, out)
        except BaseException as exc:
            log.exception("the engine loop failed; every open request is failed and the engine stops")
            self._fail(EngineDeadError(f"the engine failed: {type(exc).__name__}: {exc}"))
            return
        # Shut down: abort what is left so every block returns, and tell the callers.
        self._close(EngineShutdownError("the engine is shutting down"))

    def _run_commands(self, block: bool) -> None:
        try:
            while True:
                fn, fut = self._commands.get(block=block)
                block = False
                self._run_command(fn, fut)
        except queue.Empty:
            pass

    def _run_command(self, fn: Callable[[], Any], fut: Future[Any] | None) -> None:
        if fut is not None and not fut.set_running_or_notify_cancel():
            return  # its caller gave up before it ran (cancelled); the caller's abort follows it
        try:
            result = fn()
        except Exception as exc:
            if fut is None:
                raise  # an abort or snapshot that fails means the engine's state is broken
            fut.set_exception(exc)  # the caller's own error (e.g. a refused request)
            return
        self._snapshot = self._take_snapshot()
        if fut is not None:
            fut.set_result(result)

    def _abort_all(self) -> None:
        for rid, stream in list(self._streams.items()):
            self.core.abort(rid)
            _deliver(stream, EngineShutdownError(f"request {rid} aborted: the engine is shutting down"))

    def _close(self, error: EngineDeadError | EngineShutdownError) -> None:
        """No command is taken from now on; queued ones, and every open request, get `error`."""
        with self._lock:
            self._closed = error
            pending = []
            while not self._commands.empty():
                pending.append(self._commands.get_nowait())
        for _, fut in pending:
            if fut is not None and fut.set_running_or_notify_cancel():
                fut.set_exception(error)
        for rid, stream in list(self._streams.items()):
            try:
                self.core.abort(rid)
            except Exception:  # a failed engine may not manage it; the request is failed regardless
                log.exception("could not abort %s", rid)
            _deliver(stream, error)
        self._snapshot = self._take_snapshot_or_last()

    def _fail(self, error: EngineDeadError) -> None:
        self._close(error)
        for callback in self._failure_callbacks:
            try:
                callback(error)
            except Exception:
                log.exception("engine failure callback failed")

    def _take_snapshot_or_last(self) -> dict[str, Any]:
        try:
            return self._take_snapshot()
        except Exception:
            return self._snapshot


def _deliver(stream: _Stream, item: RequestOutput | BaseException) -> None:
    """Hand an item to a caller's event loop; a loop that has closed has nobody left to tell."""
    try:
        stream.loop.call_soon_threadsafe(stream.queue.put_nowait, item)
    except RuntimeError:
        pass
