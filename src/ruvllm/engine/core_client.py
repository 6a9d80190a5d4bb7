"""How the front reaches the engine core: a thread of this process, or a child process over ZeroMQ.

Both carry the same self-contained messages (ruvllm/messages.py) and give the front the same
interface: add and abort never block, outputs and failures arrive through callbacks on a thread of
the client's, and `call` answers in order with the other commands (so after an abort, a "stats"
call sees the abort done). The process client is what `ruvllm serve` runs: the engine loop then has
an interpreter (and its lock) of its own, apart from the HTTP server's event loop and detokenizing.
"""

from __future__ import annotations

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
from ruvllm.errors import AdapterNotFoundError, EngineDeadError, EngineShutdownError
from ruvllm.messages import (AbortRequests, AddRequests, CoreFailed, CoreMessage, CoreOutput, CoreRequest,
                             EngineInfo, EngineStats, Ready, Shutdown, StepOutputs, Utility, UtilityResult)

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

    def call(self, method: str, *args: str, timeout: float = 60.0) -> EngineStats: ...

    @property
    def latest_stats(self) -> EngineStats: ...

    @property
    def is_alive(self) -> bool: ...

    def replica_states(self) -> list[ReplicaState]: ...

    def shutdown(self) -> None: ...


def run_utility(core: EngineCore, method: str, args: list[str]) -> EngineStats:
    """The calls a front may make of the core, answered with the stats after them ("load_lora"
    goes through AdapterLoads instead: its file is read off the loop)."""
    if method == "reset_prefix_cache":
        core.reset_prefix_cache()
    elif method == "unload_lora" and len(args) == 1:
        core.remove_adapter(args[0])
    elif method != "stats":
        raise ValueError(f"unknown core call {method!r}")
    return core.stats()


Reply = Callable[[BaseException | None], None]


def load_adapter_beside_the_loop(core: EngineCore, name: str, path: str, reply: Reply) -> None:
    """Load an adapter on a thread of its own while the loop steps: read and check the file, join
    the loaded adapters (under the core's lock; a step first using it copies it into a slot), then
    `reply` from that thread, so the answer waits for no step in flight."""
    def load() -> None:
        try:
            core.install_adapter(core.read_adapter(name, path))
        except Exception as exc:
            reply(exc)
        else:
            reply(None)

    threading.Thread(target=load, name="ruvllm-adapter-load", daemon=True).start()


def add_requests(core: EngineCore, requests: list[CoreRequest], on_outputs: OnOutputs) -> None:
    """Queue requests in the core. One naming an adapter unloaded since the front checked it ends
    at once (finish reason "abort") rather than failing the core's loop."""
    refused = []
    for req in requests:
        try:
            core.add_request(req)
        except AdapterNotFoundError:
            refused.append(CoreOutput(req.request_id, finish_reason="abort"))
    if refused:
        on_outputs(refused)


class _PublishedStats:
    """The stats the core published last (after its latest step or command): read without waiting."""

    _stats: EngineStats

    @property
    def latest_stats(self) -> EngineStats:
        return self._stats

    @property
    def is_alive(self) -> bool:
        raise NotImplementedError

    def replica_states(self) -> list[ReplicaState]:
        """One core: replica 0."""
        return [ReplicaState(0, "up" if self.is_alive else "stopped", self._stats)]


class ThreadCoreClient(_PublishedStats):
    """The core on one dedicated thread of this process: the only thread that touches the model,
    the scheduler and the KV cache. For tests, notebooks and models built in memory."""

    def __init__(self, core: EngineCore) -> None:
        self.core = core
        self.info = core.info
        self._commands: queue.Queue[tuple[str, Any]] = queue.Queue()
        self._stats = core.stats()
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self, on_outputs: OnOutputs, on_failure: OnFailure, on_lost: OnLost | None = None) -> None:
        # One core: its failure is the engine's, so no sequence is ever lost alone (on_lost unused).
        self._on_outputs, self._on_failure = on_outputs, on_failure
        self._thread = threading.Thread(target=self._loop, name="ruvllm-engine", daemon=True)
        self._thread.start()

    def add(self, requests: list[CoreRequest]) -> None:
        self._commands.put(("add", requests))

    def abort(self, request_ids: list[str]) -> None:
        self._commands.put(("abort", request_ids))

    def call(self, method: str, *args: str, timeout: float = 60.0) -> EngineStats:
        fut: Future[EngineStats] = Future()
        self._commands.put(("call", (method, list(args), fut)))
        return fut.result(timeout=timeout)

    @property
    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._stopping.is_set()

    def shutdown(self) -> None:
        self._stopping.set()
        self._commands.put(("wake", None))
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=30)

    def _loop(self) -> None:
        core = self.core
        try:
            while not self._stopping.is_set():
                self._run_commands(block=not core.has_unfinished)
                if self._stopping.is_set() or not core.has_unfinished:
                    continue
                outputs = core.step()
                self._stats = core.stats()
                if outputs:
                    self._on_outputs(outputs)
        except BaseException as exc:
            log.exception("the engine loop failed")
            self._on_failure(EngineDeadError(f"the engine failed: {type(exc).__name__}: {exc}"))
            return
        # Shut down: whatever is left is aborted, so every block returns to the pool.
        core.abort(list(core.scheduler.requests))
        self._stats = core.stats()

    def _run_commands(self, block: bool) -> None:
        while True:
            try:
                kind, arg = self._commands.get(block=block)
            except queue.Empty:
                return
            block = False
            if kind == "add":
                add_requests(self.core, arg, self._on_outputs)
            elif kind == "abort":
                self.core.abort(arg)
            elif kind == "call":
                method, args, fut = arg
                if not fut.set_running_or_notify_cancel():
                    continue
                if method == "load_lora" and len(args) == 2:
                    load_adapter_beside_the_loop(self.core, args[0], args[1], lambda exc, fut=fut: self._answer(fut, exc))
                    continue
                try:
                    fut.set_result(run_utility(self.core, method, args))
                except Exception as exc:
                    fut.set_exception(exc)
            self._stats = self.core.stats()

    def _answer(self, fut: Future[EngineStats], error: BaseException | None) -> None:
        self._stats = self.core.stats()
        if error is None:
            fut.set_result(self._stats)
        else:
            fut.set_exception(error)


# --- the core in a child process ---------------------------------------------------------------------
_ERROR_TYPES = {name: getattr(errors, name) for name in dir(errors)
                if isinstance(getattr(errors, name), type) and issubclass(getattr(errors, name), Exception)}
_ERROR_TYPES.update(ValueError=ValueError, FileNotFoundError=FileNotFoundError)

# How often the receiving thread looks at the child when no message comes: the bound on how late a
# dead core is noticed (the issue asks for every open request to hear of it within 2 s).
_LIVENESS_POLL_S = 0.2


def rebuild_error(failed: CoreFailed) -> Exception:
    """The child's exception as the same type here (ruvllm's own, ValueError), else EngineDeadError."""
    cls = _ERROR_TYPES.get(failed.error_type, EngineDeadError)
    try:
        return cls(failed.message)
    except TypeError:
        return EngineDeadError(failed.message)


class ProcessCoreClient(_PublishedStats):
    """The core (worker, scheduler, KV cache) in a spawned child process.

    The front binds two sockets in a private directory: PUSH for commands, PULL for the child's
    messages. A thread of the front receives and hands outputs on; when no message comes it checks
    that the child lives, so a core that dies (killed, out of memory) fails every open request at
    once rather than leaving it to wait. Shutdown asks the child to leave, then terminates it,
    then kills it, and always joins it: no zombie is left behind."""

    def __init__(self, config: EngineConfig, cpus: set[int] | None = None) -> None:
        """Starts the child, which loads the model; `wait_ready` waits for it (the front can load
        its tokenizer meanwhile). `cpus`: the cores the child (and every thread it starts) may run on."""
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
        self._calls: dict[int, Future[EngineStats]] = {}
        self._next_call = 0
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

    def add(self, requests: list[CoreRequest]) -> None:
        self._send(AddRequests(requests))

    def abort(self, request_ids: list[str]) -> None:
        try:
            self._send(AbortRequests(request_ids))
        except EngineDeadError:
            pass  # nothing left to abort

    def call(self, method: str, *args: str, timeout: float = 60.0) -> EngineStats:
        fut: Future[EngineStats] = Future()
        with self._send_lock:
            call_id = self._next_call
            self._next_call += 1
            self._calls[call_id] = fut
        self._send(Utility(call_id, method, list(args)))
        return fut.result(timeout=timeout)

    @property
    def is_alive(self) -> bool:
        return not self._dead and not self._stopping.is_set() and self.process.poll() is None

    def _receive(self) -> None:
        try:
            while True:
                if self._out.poll(int(_LIVENESS_POLL_S * 1000)):
                    msg = self._decoder.decode(self._out.recv())
                    if isinstance(msg, StepOutputs):
                        self._stats = msg.stats
                        if msg.outputs:
                            self._on_outputs(msg.outputs)
                    elif isinstance(msg, UtilityResult):
                        self._stats = msg.stats
                        fut = self._calls.pop(msg.call_id, None)
                        if fut is not None and fut.set_running_or_notify_cancel():
                            if msg.error is None:
                                fut.set_result(msg.stats)
                            else:
                                fut.set_exception(rebuild_error(CoreFailed(msg.error_type or "ValueError",
                                                                           msg.error)))
                    elif isinstance(msg, CoreFailed):
                        self._die(EngineDeadError(f"the engine failed: {msg.message}"))
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
            calls, self._calls = self._calls, {}
        for fut in calls.values():
            if fut.set_running_or_notify_cancel():
                fut.set_exception(error)
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
        with self._send_lock:
            calls, self._calls = self._calls, {}
        for fut in calls.values():
            if fut.set_running_or_notify_cancel():
                fut.set_exception(EngineShutdownError("the engine is shut down"))
        self._in.close(0)
        self._out.close(0)
        self._ctx.term()
        shutil.rmtree(self._dir, ignore_errors=True)

    def _reap(self) -> None:
        """Join the child however it ends: asked (Shutdown), then SIGTERM, then SIGKILL."""
        proc = self.process
        # A child still loading reads no command until it is ready: terminate it at once.
        asked = 10 if self._loaded else 0
        for stop, wait in ((None, asked), (proc.terminate, 5), (proc.kill, 5)):
            if stop is not None:
                stop()
            try:
                proc.wait(timeout=wait)
                return
            except subprocess.TimeoutExpired:
                continue
