"""How the front reaches the engine core: the caller's own thread (`LLM`), a thread of this process,
or a child process over ZeroMQ.

All three run the same loop (core_loop.py) over the same self-contained messages (messages.py) and
give the front the same interface: add and abort never block, outputs and failures arrive through
callbacks, and `call` answers in order with the other commands (so after an abort, GetStats sees
the abort done). The process client is what `ruvllm serve` runs: the engine loop then has
an interpreter (and its lock) of its own, apart from the HTTP server's event loop and detokenizing.
"""

from __future__ import annotations

import itertools
import logging
import os
import pickle
import queue
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Protocol

import msgspec
import zmq

from ruvllm import errors
from ruvllm.config import EngineConfig
from ruvllm.core.engine_core import EngineCore
from ruvllm.engine.core_loop import CoreLoop
from ruvllm.errors import EngineDeadError, EngineShutdownError, RuvllmError
from ruvllm.messages import (AbortRequests, AddRequests, Call, CallResult, CoreCall, CoreFailed, CoreInput,
                             CoreMessage, CoreOutput, CoreRequest, EngineInfo, EngineStats, Ready, Shutdown,
                             StepOutputs)
from ruvllm.reaping import reap

log = logging.getLogger(__name__)

OnOutputs = Callable[[list[CoreOutput]], None]
OnFailure = Callable[[EngineDeadError], None]
# Sequences lost with a data-parallel replica that failed (the engine serves on): their callers' error.
OnLost = Callable[[list[str], BaseException], None]


@dataclass(frozen=True)
class ReplicaState:
    """One engine core behind the front, as /metrics and /health show it."""

    index: int
    status: str  # "up", "restarting", "failed" (given up on), "stopped"
    stats: EngineStats
    restarts: int = 0
    last_error: str | None = None


class CoreClient(Protocol):
    info: EngineInfo

    def start(self, on_outputs: OnOutputs, on_failure: OnFailure, on_lost: OnLost | None = None) -> None: ...

    def add(self, requests: list[CoreRequest]) -> None: ...

    def abort(self, request_ids: list[str]) -> None: ...

    def call(self, call: CoreCall, timeout: float = 60.0) -> CallResult: ...

    @property
    def latest_stats(self) -> EngineStats: ...

    @property
    def is_alive(self) -> bool: ...

    def replica_states(self) -> list[ReplicaState]: ...

    def shutdown(self) -> None: ...


class _OneCore:
    """What the clients of one core share: commands out, and the core's messages in (through a
    dispatch table) as the front's callbacks, the answers of calls, and the stats published last."""

    info: EngineInfo
    _on_outputs: OnOutputs

    def __init__(self) -> None:
        self._stats = EngineStats()
        self._calls: dict[int, Future[CallResult]] = {}
        self._call_ids = itertools.count()
        self._calls_lock = threading.Lock()
        self._messages: dict[type, Callable[[Any], None]] = {
            StepOutputs: self._step_outputs, CallResult: self._call_result, CoreFailed: self._core_failed}

    def _send(self, msg: CoreInput) -> None:
        raise NotImplementedError

    def _die(self, error: EngineDeadError) -> None:
        raise NotImplementedError

    def add(self, requests: list[CoreRequest]) -> None:
        self._send(AddRequests(requests))

    def abort(self, request_ids: list[str]) -> None:
        self._send(AbortRequests(request_ids))

    def call(self, call: CoreCall, timeout: float = 60.0) -> CallResult:
        return self._request(call).result(timeout=timeout)

    def _request(self, call: CoreCall) -> Future[CallResult]:
        fut: Future[CallResult] = Future()
        with self._calls_lock:
            call_id = next(self._call_ids)
            self._calls[call_id] = fut
        self._send(Call(call_id, call))
        return fut

    def _on_message(self, msg: CoreMessage) -> None:
        self._messages[type(msg)](msg)

    def _step_outputs(self, msg: StepOutputs) -> None:
        self._stats = msg.stats
        if msg.outputs:
            self._on_outputs(msg.outputs)

    def _call_result(self, msg: CallResult) -> None:
        self._stats = msg.stats
        with self._calls_lock:
            fut = self._calls.pop(msg.call_id, None)
        if fut is None or not fut.set_running_or_notify_cancel():
            return
        if msg.error is None:
            fut.set_result(msg)
        else:
            # A call's error leaves the core running: never EngineDeadError for a type we do not know.
            fut.set_exception(rebuild_error(CoreFailed(msg.error_type or "ValueError", msg.error), RuvllmError))

    def _core_failed(self, msg: CoreFailed) -> None:
        self._die(EngineDeadError(f"the engine failed: {msg.message}"))

    def _fail_calls(self, error: Exception) -> None:
        with self._calls_lock:
            calls, self._calls = self._calls, {}
        for fut in calls.values():
            if fut.set_running_or_notify_cancel():
                fut.set_exception(error)

    @property
    def latest_stats(self) -> EngineStats:
        """The stats the core published last (after its latest step or command): read without waiting."""
        return self._stats

    @property
    def is_alive(self) -> bool:
        raise NotImplementedError

    def replica_states(self) -> list[ReplicaState]:
        """One core: replica 0."""
        return [ReplicaState(0, "up" if self.is_alive else "stopped", self._stats)]


class InlineCoreClient(_OneCore):
    """The core driven by the caller's own thread: each `poll()` is one turn of the loop (`LLM`).
    Commands wait in a queue until then; a call takes the queued commands itself (no step)."""

    def __init__(self, core: EngineCore) -> None:
        super().__init__()
        self.core = core
        self.info = core.info
        self._stats = core.stats()
        self._queue: queue.Queue[CoreInput] = queue.Queue()
        self._loop = CoreLoop(core, self._on_message)

    def start(self, on_outputs: OnOutputs, on_failure: OnFailure, on_lost: OnLost | None = None) -> None:
        # One core: its failure is the engine's, so no sequence is ever lost alone (on_lost unused).
        self._on_outputs, self._on_failure = on_outputs, on_failure

    def _send(self, msg: CoreInput) -> None:
        self._queue.put(msg)

    def _receive(self, timeout: float | None) -> CoreInput | None:
        try:
            return self._queue.get(block=timeout != 0, timeout=timeout)
        except queue.Empty:
            return None

    def poll(self) -> None:
        """One turn: the queued commands, then a step if anything is unfinished. A failure raises."""
        self._loop.run_once(self._receive, 0.0)

    def call(self, call: CoreCall, timeout: float = 60.0) -> CallResult:
        fut = self._request(call)
        self._loop.take_commands(self._receive, 0.0)  # answered without a step
        return fut.result(timeout=timeout)

    def _die(self, error: EngineDeadError) -> None:
        raise error

    @property
    def is_alive(self) -> bool:
        return not self._loop.stopped

    def shutdown(self) -> None:
        self._loop.stopped = True
        self._loop.close()


class ThreadCoreClient(InlineCoreClient):
    """The same loop on one dedicated thread of this process: the only thread that touches the
    model, the scheduler and the KV cache. For tests, notebooks and models built in memory."""

    def __init__(self, core: EngineCore) -> None:
        super().__init__(core)
        self._thread: threading.Thread | None = None

    def start(self, on_outputs: OnOutputs, on_failure: OnFailure, on_lost: OnLost | None = None) -> None:
        super().start(on_outputs, on_failure)
        self._thread = threading.Thread(target=self._run, name="ruvllm-engine", daemon=True)
        self._thread.start()

    def call(self, call: CoreCall, timeout: float = 60.0) -> CallResult:
        return self._request(call).result(timeout=timeout)

    def _run(self) -> None:
        try:
            while self._loop.run_once(self._receive, None):
                pass
        except BaseException as exc:
            log.exception("the engine loop failed")
            error = EngineDeadError(f"the engine failed: {type(exc).__name__}: {exc}")
            self._loop.stopped = True
            self._fail_calls(error)
            self._on_failure(error)
            return
        self._loop.close()

    @property
    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._loop.stopped

    def shutdown(self) -> None:
        self._send(Shutdown())
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=30)


# --- the core in a child process ---------------------------------------------------------------------
_ERROR_TYPES = {name: getattr(errors, name) for name in dir(errors)
                if isinstance(getattr(errors, name), type) and issubclass(getattr(errors, name), Exception)}
_ERROR_TYPES.update(ValueError=ValueError, FileNotFoundError=FileNotFoundError)

# How often the receiving thread looks at the child when no message comes: the bound on how late a
# dead core is noticed (the issue asks for every open request to hear of it within 2 s).
_LIVENESS_POLL_S = 0.2


def rebuild_error(failed: CoreFailed, other: type[Exception] = EngineDeadError) -> Exception:
    """The child's exception as the same type here (ruvllm's own, ValueError), else `other`."""
    cls = _ERROR_TYPES.get(failed.error_type, other)
    try:
        return cls(failed.message)
    except TypeError:
        return other(failed.message)


class ProcessCoreClient(_OneCore):
    """The core (worker, scheduler, KV cache) in a spawned child process.

    The front binds two sockets in a private directory: PUSH for commands, PULL for the child's
    messages. A thread of the front receives and hands outputs on; when no message comes it checks
    that the child lives, so a core that dies (killed, out of memory) fails every open request at
    once rather than leaving it to wait. Shutdown asks the child to leave, then terminates it,
    then kills it, and always joins it: no zombie is left behind."""

    def __init__(self, config: EngineConfig, cpus: set[int] | None = None) -> None:
        """Starts the child, which loads the model; `wait_ready` waits for it (the front can load
        its tokenizer meanwhile). `cpus`: the cores the child (and every thread it starts) may run on."""
        super().__init__()
        self._dir = tempfile.mkdtemp(prefix="ruvllm-core-")
        in_addr, out_addr = f"ipc://{self._dir}/in", f"ipc://{self._dir}/out"
        self._ctx = zmq.Context()
        self._in = self._ctx.socket(zmq.PUSH)
        self._in.setsockopt(zmq.LINGER, 0)
        self._in.bind(in_addr)
        self._out = self._ctx.socket(zmq.PULL)
        self._out.setsockopt(zmq.LINGER, 0)
        self._out.bind(out_addr)
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(CoreMessage)
        self._send_lock = threading.Lock()
        self._stopping = threading.Event()
        self._dead = False
        self._loaded = False  # set by wait_ready: until then the child reads no command
        self._thread: threading.Thread | None = None
        # A fresh interpreter (spawn semantics: no forked threads, locks or CUDA state), started as
        # `python -m` rather than through multiprocessing, which would re-import the caller's
        # __main__ in the child: scripts without a __main__ guard and notebooks work as they are.
        # The child logs at this process's level (`ruvllm -v` shows the core's load and KV sizing too).
        # As a number: a custom level has no name basicConfig would take back.
        env = {**os.environ, "RUVLLM_LOG": str(logging.getLogger().getEffectiveLevel())}
        if config.num_threads is not None:  # OpenMP pools the child's libraries start get the same count
            env["OMP_NUM_THREADS"] = str(config.num_threads)
        self.process = subprocess.Popen(
            [sys.executable, "-m", "ruvllm.engine.core_process", in_addr, out_addr, str(os.getpid())],
            stdin=subprocess.PIPE, env=env)
        try:
            if cpus:  # set before the child has started any thread (it is still importing): all inherit it
                os.sched_setaffinity(self.process.pid, cpus)
            assert self.process.stdin is not None
            self.process.stdin.write(pickle.dumps(config))
            self.process.stdin.close()
        except BaseException:
            self._reap()
            raise

    def wait_ready(self, timeout: float = 600.0) -> None:
        """Until the child has loaded the model (then `info` is set); its load error, re-raised here."""
        try:
            ready = self._ready(timeout)
        except BaseException:
            self._reap()
            raise
        self.info = ready.info
        self._stats = ready.stats
        self._loaded = True

    def _ready(self, timeout: float) -> Ready:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._out.poll(int(_LIVENESS_POLL_S * 1000)):
                msg = self._decoder.decode(self._out.recv())
                if isinstance(msg, Ready):
                    return msg
                if isinstance(msg, CoreFailed):
                    raise rebuild_error(msg)
            elif self.process.poll() is not None:
                raise EngineDeadError(f"the engine core process exited with code {self.process.returncode} "
                                      "while loading the model")
        raise EngineDeadError(f"the engine core did not start within {timeout:.0f} s")

    def start(self, on_outputs: OnOutputs, on_failure: OnFailure, on_lost: OnLost | None = None) -> None:
        self._on_outputs, self._on_failure = on_outputs, on_failure
        self._thread = threading.Thread(target=self._receive, name="ruvllm-core-output", daemon=True)
        self._thread.start()

    def _send(self, msg: Any) -> None:
        data = self._encoder.encode(msg)
        with self._send_lock:
            # A PUSH socket with no peer (a child not yet connected, or gone) blocks a send: wait
            # for room in liveness-poll steps, so a dead child fails the send instead of hanging it.
            while not self._dead and not self._in.poll(int(_LIVENESS_POLL_S * 1000), zmq.POLLOUT):
                self._dead = self.process.poll() is not None
            if self._dead:
                raise EngineDeadError("the engine core process is gone")
            self._in.send(data, copy=False)

    def abort(self, request_ids: list[str]) -> None:
        try:
            self._send(AbortRequests(request_ids))
        except EngineDeadError:
            pass  # nothing left to abort

    @property
    def is_alive(self) -> bool:
        return not self._dead and not self._stopping.is_set() and self.process.poll() is None

    def _receive(self) -> None:
        # A receive that waits at most the liveness poll: one call per message (a poll before each
        # receive would be a second one, per token of every stream).
        self._out.setsockopt(zmq.RCVTIMEO, int(_LIVENESS_POLL_S * 1000))
        try:
            while True:
                try:
                    data = self._out.recv()
                except zmq.Again:
                    data = None
                if data is not None:
                    msg = self._decoder.decode(data)
                    self._on_message(msg)
                    if isinstance(msg, CoreFailed):
                        return
                elif self.process.poll() is not None:
                    if self._stopping.is_set():
                        return
                    self._die(EngineDeadError(
                        f"the engine core process exited unexpectedly (exit code {self.process.returncode})"))
                    return
                elif self._stopping.is_set():
                    return
        except Exception as exc:  # a message we cannot read means the two sides disagree: stop
            log.exception("reading the engine core's messages failed")
            self._die(EngineDeadError(f"the engine core's messages could not be read: {exc}"))

    def _die(self, error: EngineDeadError) -> None:
        with self._send_lock:
            self._dead = True
        self._fail_calls(error)
        self._on_failure(error)
        self._reap()

    def shutdown(self) -> None:
        if self._stopping.is_set():
            return
        self._stopping.set()
        if self._loaded:  # a child still loading reads no command: _reap terminates it
            try:
                self._send(Shutdown())
            except EngineDeadError:
                pass
        self._reap()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
        self._fail_calls(EngineShutdownError("the engine is shut down"))
        self._in.close(0)
        self._out.close(0)
        self._ctx.term()
        shutil.rmtree(self._dir, ignore_errors=True)

    def _reap(self) -> None:
        # A child still loading reads no command until it is ready: terminate it at once.
        reap(self.process, 10.0 if self._loaded else 0.0)
