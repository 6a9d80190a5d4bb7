"""How the front reaches the engine core: the caller's own thread (`LLM`), a thread of this process,
or a child process (commands over ZeroMQ, its messages back as frames on a Unix socket).

All three run the same loop (core_loop.py) over the same self-contained messages (messages.py) and
give the front the same interface: add and abort never block, outputs and failures arrive through
callbacks, and `call` answers in order with the other commands (so after an abort, GetStats sees
the abort done). The process client is what `ruvllm serve` runs: the engine loop then has
an interpreter (and its lock) of its own, apart from the HTTP server's event loop and detokenizing.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import pickle
import queue
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
from ruvllm.engine.core_channel import FrameReader, answer_bell, doorbell, socket_pair
from ruvllm.engine.core_launcher import CoreLauncher, LaunchedCore
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

    Commands go out on a ZeroMQ PUSH socket bound in a private directory (sent from any thread,
    never waiting for the core). The child's messages come back as frames on one end of a Unix
    socket pair whose other end the child inherits (core_channel.py): the core's loop writes them
    itself, so no ZeroMQ I/O thread wakes on either side per step. A thread of the front receives
    and hands outputs on; when no message comes it checks that the child lives, and the child's exit
    is an end of file at once, so a core that dies (killed, out of memory) fails every open request
    rather than leaving it to wait. A server moves the receiving onto its event loop (`read_on`):
    the loop watches the core's doorbell (rung after each frame; core_channel.py says why not the
    socket) and checks the child every liveness poll, so a step's outputs reach the streams without a thread's
    wake-up, its hand-over of the interpreter's lock and a second wake-up of the loop (at one
    stream, that CPU a token is taken from the cores the engine computes on). Shutdown asks the
    child to leave, then terminates it, then kills it, and always joins it: no zombie is left behind."""

    def __init__(self, config: EngineConfig, cpus: set[int] | None = None,
                 launcher: CoreLauncher | None = None) -> None:
        """Starts the child, which loads the model; `wait_ready` waits for it (the front can load
        its tokenizer meanwhile). `cpus`: the cores the child (and every thread it starts) may run on.
        `launcher`: fork the child from it (its modules imported already: core_launcher.py), rather
        than start a fresh interpreter."""
        super().__init__()
        # The command socket's folder: removed at shutdown, or at this interpreter's exit for a client
        # never shut down (TemporaryDirectory's finalizer); a killed front's is removed by its core.
        self._tmp = tempfile.TemporaryDirectory(prefix="ruvllm-core-", ignore_cleanup_errors=True)
        in_addr = f"ipc://{self._tmp.name}/in"
        self._ctx = zmq.Context()
        self._in = self._ctx.socket(zmq.PUSH)
        self._in.setsockopt(zmq.LINGER, 0)
        self._in.bind(in_addr)
        self._out, child_end = socket_pair()
        self._bell = doorbell()
        self._out.settimeout(_LIVENESS_POLL_S)  # the receiving thread's wait: then it looks at the child
        self._reader = FrameReader(self._out)
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(CoreMessage)
        self._send_lock = threading.Lock()
        self._stopping = threading.Event()
        self._dead = False
        self._loaded = False  # set by wait_ready: until then the child reads no command
        self._thread: threading.Thread | None = None
        self._handover = threading.Event()  # set: the receiving thread leaves (read_on)
        self._loop: asyncio.AbstractEventLoop | None = None  # the loop that reads, after read_on
        self._loop_thread: int | None = None
        self._liveness: asyncio.Handle | None = None
        self._watching = False  # the loop watches the socket (read_on, until its end of file)
        self._backlog: list[bytes] = []  # frames that came with Ready, handed on by the receiving thread
        # A fresh interpreter (spawn semantics: no forked threads, locks or CUDA state), started as
        # `python -m` rather than through multiprocessing, which would re-import the caller's
        # __main__ in the child: scripts without a __main__ guard and notebooks work as they are.
        # The child logs at this process's level (`ruvllm -v` shows the core's load and KV sizing too).
        # As a number: a custom level has no name basicConfig would take back.
        # TMPDIR: what the core and its children make in temporary files (tensor-parallel ranks'
        # rendezvous, for one) goes in this folder too, and leaves with it, even when the core is killed.
        env = {**os.environ, "RUVLLM_LOG": str(logging.getLogger().getEffectiveLevel()), "TMPDIR": self._tmp.name}
        # OpenMP pools the child's libraries start get the same count (a forked core's libgomp read its
        # count at the launcher's start: CoreLauncher(threads); the core sets torch's from its config).
        if config.num_threads is not None:
            env["OMP_NUM_THREADS"] = str(config.num_threads)
        try:
            if launcher is not None:
                self.process: subprocess.Popen | LaunchedCore = launcher.launch(
                    config, in_addr, (child_end.fileno(), self._bell), env, cpus)
            else:
                self.process = subprocess.Popen(
                    [sys.executable, "-m", "ruvllm.engine.core_process", in_addr, str(child_end.fileno()),
                     str(self._bell), str(os.getpid())], stdin=subprocess.PIPE, env=env,
                    pass_fds=(child_end.fileno(), self._bell))
        except BaseException:
            child_end.close()
            self._close_sockets()
            raise
        child_end.close()  # the child's own now: its exit (however it comes) is our end of file
        if launcher is not None:
            return  # the launcher handed the child its config and CPUs
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
            try:
                frames = self._reader.read()  # waits up to a liveness poll (the socket's timeout)
            except TimeoutError:
                frames = self._last_words() if self.process.poll() is not None else []
            for i, data in enumerate(frames):
                msg = self._decoder.decode(data)
                if isinstance(msg, Ready):
                    self._backlog = frames[i + 1:]  # (the core sends nothing more before a command)
                    return msg
                if isinstance(msg, CoreFailed):
                    raise rebuild_error(msg)
            if self._reader.eof or self.process.poll() is not None:
                raise EngineDeadError(f"the engine core process exited with code {self._exit_code()} "
                                      "while loading the model")
        raise EngineDeadError(f"the engine core did not start within {timeout:.0f} s")

    def _last_words(self) -> list[bytes]:
        """The frames a child that has exited wrote just before it went (they may say why), read
        without waiting from the receiving thread's socket; its end of file marked."""
        self._out.settimeout(0.0)
        try:
            return self._reader.read_ready()
        finally:
            self._reader.eof = True
            self._out.settimeout(_LIVENESS_POLL_S)

    def _handle(self, frames: list[bytes]) -> bool:
        """On the receiving thread: each frame's message handed on; False once the core has failed."""
        for data in frames:
            msg = self._decoder.decode(data)
            self._on_message(msg)
            if isinstance(msg, CoreFailed):
                return False
        return True

    def _exit_code(self) -> int | str:
        """The child's exit code, once its end of the socket has closed (its exit follows at once)."""
        try:
            return self.process.wait(_LIVENESS_POLL_S)
        except subprocess.TimeoutExpired:
            return "unknown: still exiting"

    def start(self, on_outputs: OnOutputs, on_failure: OnFailure, on_lost: OnLost | None = None) -> None:
        self._on_outputs, self._on_failure = on_outputs, on_failure
        self._thread = threading.Thread(target=self._receive, name="ruvllm-core-output", daemon=True)
        self._thread.start()

    async def read_on(self) -> None:
        """Receive the core's messages on the running event loop from now on, not on the receiving
        thread: callbacks then run on the loop. For a loop that outlives the client's use (a
        server's): blocking `call`s must then come from other threads."""
        loop = asyncio.get_running_loop()
        if self._thread is None or self._loop is not None or self._handover.is_set():
            raise RuntimeError("read_on: the client is not started, or already reads on a loop")
        self._handover.set()
        # The socket is one thread's at a time: the thread's receive ends within a liveness poll.
        await asyncio.to_thread(self._thread.join)
        if self._dead or self._stopping.is_set():
            return  # the thread saw the end already
        self._loop, self._loop_thread = loop, threading.get_ident()
        self._out.setblocking(False)
        # The bell's count holds every ring since the child started: what came before the watch
        # is seen at once.
        loop.add_reader(self._bell, self._drain)
        self._watching = True
        self._liveness = loop.call_later(_LIVENESS_POLL_S, self._check_alive)

    def _drain(self) -> None:
        """The bell rang: the messages the socket holds, handed on (one receive gets them all
        unless it filled its buffer; a frame written after the bell's reset rings it again). At its
        end of file the child has exited: the next liveness check says so at once."""
        answer_bell(self._bell)
        frames: list[bytes] = []
        try:
            frames += self._reader.read()
            while self._reader.more:
                frames += self._reader.read()
        except (BlockingIOError, InterruptedError):
            pass
        except Exception as exc:
            self._unreadable(exc)
            return
        self._dispatch(frames)
        if self._reader.eof and self._loop is not None:
            self._unwatch(self._loop)
            self._liveness.cancel()  # type: ignore[union-attr]
            self._liveness = self._loop.call_soon(self._check_alive)

    def _dispatch(self, frames: list[bytes]) -> bool:
        """Each frame's message handed on, on the loop, until the reading stops (a failure):
        whether it goes on."""
        try:
            for data in frames:
                if self._loop is None:
                    return False
                self._on_message(self._decoder.decode(data))
        except Exception as exc:
            self._unreadable(exc)
            return False
        return True

    def _unreadable(self, exc: Exception) -> None:
        """A message we cannot read means the two sides disagree: stop."""
        log.exception("reading the engine core's messages failed")
        self._die(EngineDeadError(f"the engine core's messages could not be read: {exc}"))

    def _check_alive(self) -> None:
        """Every liveness poll on the loop (and at once after the socket's end of file): a child that
        is gone fails everything (after its last messages, which may say why)."""
        if self._loop is None:
            return
        if self.process.poll() is None:
            self._liveness = self._loop.call_later(_LIVENESS_POLL_S, self._check_alive)
            return
        try:
            frames = self._reader.read_ready()
        except Exception as exc:
            self._unreadable(exc)
            return
        if self._dispatch(frames) and self._loop is not None and not self._stopping.is_set():
            self._die(EngineDeadError(
                f"the engine core process exited unexpectedly (exit code {self.process.returncode})"))

    def _unwatch(self, loop: asyncio.AbstractEventLoop) -> None:
        if self._watching and not loop.is_closed():
            loop.remove_reader(self._bell)
        self._watching = False

    def _stop_reading(self) -> None:
        """On the loop's thread: the loop lets go of the socket (before it is closed)."""
        loop, self._loop = self._loop, None
        if loop is None:
            return
        if self._liveness is not None:
            self._liveness.cancel()
        self._unwatch(loop)

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

    def call(self, call: CoreCall, timeout: float = 60.0) -> CallResult:
        if self._loop is not None and threading.get_ident() == self._loop_thread:
            # Its answer is read by this very thread, which would be waiting: never.
            raise RuntimeError("a blocking engine call on the event loop that reads the engine's outputs; "
                               "run it on a worker thread (asyncio.to_thread)")
        return super().call(call, timeout)

    def _receive(self) -> None:
        # A receive that waits at most the liveness poll (the socket's timeout): one call per
        # message (a poll before each receive would be a second one, per token of every stream).
        try:
            frames, self._backlog = self._backlog, []
            while True:
                if not self._handle(frames):
                    return
                frames = []
                if self._handover.is_set():
                    return
                if not self._reader.eof:
                    try:
                        frames = self._reader.read()
                        continue
                    except TimeoutError:
                        pass
                else:  # the child's end closed: it has exited, or is exiting now
                    self._exit_code()
                # Nothing came within a liveness poll, or the end of file: is the child still there?
                if self.process.poll() is not None:
                    if not self._reader.eof and not self._handle(self._last_words()):
                        return
                    if not self._stopping.is_set():
                        self._die(EngineDeadError(f"the engine core process exited unexpectedly "
                                                  f"(exit code {self.process.returncode})"))
                    return
                if self._stopping.is_set():
                    return
        except Exception as exc:  # a message we cannot read means the two sides disagree: stop
            log.exception("reading the engine core's messages failed")
            self._die(EngineDeadError(f"the engine core's messages could not be read: {exc}"))

    def _die(self, error: EngineDeadError) -> None:
        with self._send_lock:
            self._dead = True
        on_loop = self._loop is not None
        if on_loop:
            self._stop_reading()
        self._fail_calls(error)
        self._on_failure(error)
        if on_loop:  # joining the child can take seconds: not on the loop that serves the rest
            threading.Thread(target=self._reap, name="ruvllm-core-reap", daemon=True).start()
        else:
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
        self._release_loop()
        self._fail_calls(EngineShutdownError("the engine is shut down"))
        self._close_sockets()

    def _close_sockets(self) -> None:
        self._in.close(0)
        self._out.close()
        os.close(self._bell)
        self._ctx.term()
        self._tmp.cleanup()

    def _release_loop(self) -> None:
        """The reading loop lets go of the socket before it is closed: here if this is its thread,
        else on it (waited for; a loop that no longer runs holds nothing that will read)."""
        loop = self._loop
        if loop is None:
            return
        if threading.get_ident() == self._loop_thread or loop.is_closed() or not loop.is_running():
            self._stop_reading()
            return
        done = threading.Event()

        def release() -> None:
            self._stop_reading()
            done.set()

        try:
            loop.call_soon_threadsafe(release)
        except RuntimeError:  # closed meanwhile
            self._loop = None
            return
        if not done.wait(5.0):
            self._loop = None  # a loop that stopped meanwhile reads nothing more

    def _reap(self) -> None:
        # A child still loading reads no command until it is ready: terminate it at once.
        reap(self.process, 10.0 if self._loaded else 0.0)
