"""The one loop that drives an engine core, wherever it runs: inline in the caller's thread (`LLM`),
on a thread of this process (ThreadCoreClient), or in a process of its own (core_process.py).

Each turn takes every queued command, then runs one step if anything is unfinished, and emits that
step's outputs with the stats after it. Commands are typed messages (messages.py) handled through a
dispatch table; a call is answered (CallResult) in order with the other commands, so after an abort
a GetStats sees the abort done. Loading an adapter reads files: it runs on a thread of its own and
answers from there, so the answer waits for no step and no step waits for the disk.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from ruvllm.core.engine_core import EngineCore
from ruvllm.errors import AdapterNotFoundError, RuvllmError
from ruvllm.messages import (AbortRequests, AddRequests, Call, CallResult, CoreInput, CoreMessage, CoreOutput,
                             GetStats, ListAdapters, LoadAdapter, ResetPrefixCache, Shutdown, StepOutputs,
                             UnloadAdapter)

Emit = Callable[[CoreMessage], None]
# One command, waiting up to `timeout` seconds for it (None: as long as it takes); None when none came.
Receive = Callable[[float | None], CoreInput | None]


class CoreLoop:
    def __init__(self, core: EngineCore, emit: Emit, emit_from_thread: Emit | None = None) -> None:
        """`emit` sends a message from the loop's thread; `emit_from_thread` from another one. Every
        message carries the core's stats as they are then (EngineCore.stats builds them once per change)."""
        self.core = core
        self.emit = emit
        self.emit_from_thread = emit_from_thread or emit
        self.stopped = False
        self._commands: dict[type, Callable[[Any], None]] = {
            AddRequests: self._add, AbortRequests: lambda m: core.abort(m.request_ids), Call: self._call,
            Shutdown: self._stop}
        self._calls: dict[type, Callable[[Any], Any]] = {
            GetStats: lambda c: None,
            ResetPrefixCache: lambda c: core.reset_prefix_cache(),
            UnloadAdapter: lambda c: core.remove_adapter(c.name),
            ListAdapters: lambda c: core.adapter_registry.entries(),
            LoadAdapter: lambda c: core.add_adapter(c.name, c.path, c.files)}
        self._beside_the_loop = {LoadAdapter}

    def run_once(self, receive: Receive, idle_timeout: float | None) -> bool:
        """One turn: every queued command (waiting up to `idle_timeout` for the first while the core
        is idle), then one step if anything is unfinished. False once Shutdown has come."""
        handled = self.take_commands(receive, 0.0 if self.core.has_unfinished else idle_timeout)
        if self.stopped:
            return False
        if self.core.has_unfinished:
            outputs = self.core.step()
            self.emit(StepOutputs(outputs, self.core.stats()))
        elif handled:  # the commands' effect on the stats (an abort's freed blocks), published
            self.emit(StepOutputs([], self.core.stats()))
        return True

    def take_commands(self, receive: Receive, timeout: float | None) -> bool:
        """Handle every queued command (waiting up to `timeout` for the first): whether any came."""
        handled = False
        while not self.stopped and (msg := receive(timeout)) is not None:
            timeout, handled = 0.0, True
            self._commands[type(msg)](msg)
        return handled

    def close(self) -> None:
        """Whatever is left is aborted, so every block returns to the pool (the core stays usable:
        an LLM's core may serve an AsyncEngine for a while, then the LLM again)."""
        self.core.abort(list(self.core.scheduler.requests))

    def _stop(self, _: Shutdown) -> None:
        self.stopped = True

    def _add(self, msg: AddRequests) -> None:
        """Queue requests. One naming an adapter unloaded since the front checked it ends at once
        (finish reason "abort") rather than failing the loop."""
        refused = []
        for req in msg.requests:
            try:
                self.core.add_request(req)
            except AdapterNotFoundError:
                refused.append(CoreOutput(req.request_id, finish_reason="abort"))
        if refused:
            self.emit(StepOutputs(refused, self.core.stats()))

    def _call(self, msg: Call) -> None:
        if type(msg.call) in self._beside_the_loop:
            threading.Thread(target=self._answer, args=(msg, self.emit_from_thread, Exception),
                             name="ruvllm-core-call", daemon=True).start()
        else:  # an unexpected error here is the core's failure, as a step's would be
            self._answer(msg, self.emit, (ValueError, RuvllmError))

    def _answer(self, msg: Call, emit: Emit, refused: type[BaseException] | tuple[type[BaseException], ...]) -> None:
        try:
            value = self._calls[type(msg.call)](msg.call)
        except refused as exc:
            emit(CallResult(msg.call_id, self.core.stats(), str(exc), type(exc).__name__))
        else:
            emit(CallResult(msg.call_id, self.core.stats(), adapters=value or []))
