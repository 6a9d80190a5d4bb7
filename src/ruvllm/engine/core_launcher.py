"""A parent for engine cores that has already imported torch and the engine: cores fork from it.

A core started as a fresh interpreter (`python -m ruvllm.engine.core_process`) spends most of its
start importing: on the 2-core AVX2 EPYC a default-model core was ready 2.9-3.5 s after its start
and 1.0-1.2 s after a fork from this launcher (benchmarks/model_switch.py; docs/benchmarks.md,
session 24); importing torch and the engine's modules alone took ~3.7 s of CPU there. A
front that starts several cores over its life (data-parallel replicas and their restarts, a
many-models server loading and unloading models) starts this launcher once: one interpreter that
imports those modules and then only forks, never computes, so each child starts with them imported
and without threads, CUDA state or locks held (the launcher starts none of them). A front that
starts one core (`ruvllm serve`, `LLM(process=True)`) spawns it directly: a launcher would cost the
same imports once more.

The front and the launcher talk over a Unix SEQPACKET socket pair: the front sends a request (the
pickled config, the core's arguments, its environment, working folder and CPUs) with the core's two
inherited descriptors (its socket end and doorbell) as SCM_RIGHTS; the launcher forks, answers the
child's pid with a pidfd for it, and later reports each child's exit status, which only it (the
parent) can read.
`LaunchedCore` is the front's handle with Popen's interface (pid, poll, wait, terminate, kill,
returncode), signalling through a pidfd, so a signal never reaches a reused pid. The children's
parent is the launcher: a core leaves when its parent changes (core_process.py), and the launcher
leaves when the front's end of the socket closes, so a killed front leaves no core behind.
"""

from __future__ import annotations

import functools
import os
import pickle
import select
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from typing import Any

# A request is a pickled EngineConfig and the front's environment: a few KiB. SEQPACKET keeps each
# message whole up to the socket's send buffer (~208 KiB by default), far above it.
_MAX_MESSAGE = 1 << 18
_STARTED_S = 120.0  # how long a launch waits for the fork's answer (a new launcher imports first: ~4 s)


@functools.cache
def available() -> bool:
    """Whether this system can run a launcher (Linux: pidfds, since 5.3; SEQPACKET Unix sockets).
    Elsewhere the fronts spawn each core as a fresh interpreter, as a one-core front always does."""
    if not (sys.platform.startswith("linux") and hasattr(os, "pidfd_open") and hasattr(socket, "SOCK_SEQPACKET")):
        return False
    try:
        os.close(os.pidfd_open(os.getpid()))  # a seccomp profile may refuse the call (ENOSYS, EPERM)
        return True
    except OSError:
        return False


def start(threads: int | None = None) -> CoreLauncher | None:
    """A CoreLauncher (`threads`: its OpenMP count) where this system can run one, else None: the front
    then spawns each core as a fresh interpreter."""
    return CoreLauncher(threads) if available() else None


def _readable(fd: int, timeout: float) -> bool:
    """Whether `fd` is readable within `timeout` seconds (poll(2): any descriptor number, where
    select(2) fails at 1024 and above)."""
    p = select.poll()
    p.register(fd, select.POLLIN)
    return bool(p.poll(max(0, int(timeout * 1000))))


@dataclass
class _Request:
    config: bytes  # the pickled EngineConfig
    in_addr: str  # the front's command socket (ZeroMQ)
    env: dict[str, str]
    cwd: str | None  # None: the front's folder no longer exists (the core keeps the launcher's)
    cpus: set[int] | None


class LauncherError(OSError):
    """The launcher could not start a core (the fork failed, or it is gone)."""


class CoreLauncher:
    """The launcher process, started by the constructor; `launch` forks a core from it. `threads`:
    the OpenMP thread count its libraries start with (libgomp reads it once, at the launcher's
    import of torch; each core also sets its own count through torch, as a spawned one does)."""

    def __init__(self, threads: int | None = None) -> None:
        self._lock = threading.Lock()  # one reader and writer of the socket at a time
        self._exits: dict[int, int] = {}  # pid -> exit status, reported and not yet taken
        self._threads = threads
        self._proc: subprocess.Popen | None = None
        self._sock: socket.socket | None = None
        self._generation = 0  # a new launcher after one died: its cores' reports went with it
        self._closed = False
        self._start()

    def _start(self) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        env = dict(os.environ)
        # numpy's OpenBLAS (imported with torch) starts its threads at load: one, in a process that
        # only forks. The cores' BLAS is torch's own.
        env["OPENBLAS_NUM_THREADS"] = "1"
        if self._threads is not None:
            env["OMP_NUM_THREADS"] = str(self._threads)
        try:
            self._proc = subprocess.Popen([sys.executable, "-m", "ruvllm.engine.core_launcher", str(theirs.fileno())],
                                          pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL, env=env)
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        self._sock = ours
        self._generation += 1

    @property
    def pid(self) -> int:
        assert self._proc is not None
        return self._proc.pid

    def launch(self, config: Any, in_addr: str, fds: tuple[int, int], env: dict[str, str],
               cpus: set[int] | None) -> LaunchedCore:
        """A core forked from the launcher, running `core_process.run_core(config, in_addr, *fds, ...)`
        with `env` as its environment, this process's working folder, and `cpus` as its affinity."""
        try:
            cwd: str | None = os.getcwd()
        except FileNotFoundError:
            cwd = None
        request = pickle.dumps(_Request(pickle.dumps(config), in_addr, env, cwd, cpus))
        with self._lock:
            if self._closed:
                raise LauncherError("the engine core launcher is closed")
            if self._sock is None or (self._proc is not None and self._proc.poll() is not None):
                self._stop_locked()
                self._start()  # the launcher died (killed): a new one, as a restart needs
            assert self._sock is not None
            socket.send_fds(self._sock, [request], list(fds))
            deadline = time.monotonic() + _STARTED_S
            while True:
                left = deadline - time.monotonic()
                message, pidfd = self._read_locked(left) if left > 0 else (("timeout",), None)
                if message is None:
                    self._stop_locked()
                    raise LauncherError("the engine core launcher exited before starting the core")
                if message[0] == "timeout":
                    raise LauncherError(f"the engine core launcher did not fork within {_STARTED_S:.0f} s")
                if message[0] == "failed":
                    raise LauncherError(f"the engine core launcher could not start the core: {message[1]}")
                if message[0] == "started":
                    assert pidfd is not None
                    # A pid the launcher reaped before may be this child's now: its old status is not this one's.
                    self._exits.pop(message[1], None)
                    return LaunchedCore(self, message[1], pidfd, self._generation)

    def _read_locked(self, timeout: float) -> tuple[tuple | None, int | None]:
        """One message (and the descriptor that came with it), an exit report recorded; (None, None)
        at the launcher's end of file, (("timeout",), None) after `timeout` seconds without one."""
        assert self._sock is not None
        if not _readable(self._sock.fileno(), timeout):
            return ("timeout",), None
        data, fds, _, _ = socket.recv_fds(self._sock, _MAX_MESSAGE, 1)
        for fd in fds:
            os.set_inheritable(fd, False)  # the front's own: no process it starts holds it
        if not data:
            for fd in fds:
                os.close(fd)
            return None, None
        message = pickle.loads(data)
        if message[0] == "exited":
            self._exits[message[1]] = message[2]
        return message, (fds[0] if fds else None)

    def _drain_locked(self) -> None:
        """Every report already sent, read without waiting (a "started" comes only to the launch
        that asked, which holds the lock until it does); the launcher stopped at its end of file."""
        while self._sock is not None:
            message, _ = self._read_locked(0.0)
            if message is None:
                self._stop_locked()
            elif message[0] == "timeout":
                return

    def take_exit(self, pid: int, generation: int) -> tuple[int | None, bool]:
        """(the reported exit status of `pid`, if any, taken; whether a report can still come: its
        launcher lives). Never waits: a core's poll runs on a server's event loop. A busy socket
        (a launch under way) is read next time."""
        if self._lock.acquire(blocking=False):
            try:
                if generation == self._generation:
                    self._drain_locked()
            finally:
                self._lock.release()
        status = self._exits.pop(pid, None)
        alive = generation == self._generation and self._sock is not None
        return status, alive

    def close(self) -> None:
        """Stop the launcher, after its cores (any left see their parent change and leave). Later
        launches are refused."""
        with self._lock:
            self._closed = True
            self._stop_locked()

    def _stop_locked(self) -> None:
        if self._sock is not None:
            self._sock.close()  # its end of file: the launcher leaves
            self._sock = None
        if self._proc is not None:
            try:
                self._proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()


class LaunchedCore:
    """A core forked by a CoreLauncher, with the part of Popen's interface the core's client uses.
    Its pidfd was opened by the launcher before it could reap the child: signals through it reach
    this process and no other, and it is readable once the process has exited."""

    def __init__(self, launcher: CoreLauncher, pid: int, pidfd: int, generation: int) -> None:
        self._launcher = launcher
        self.pid = pid
        self._pidfd = pidfd
        self._generation = generation
        self.returncode: int | None = None
        self._lock = threading.Lock()  # polled by the client's receiving thread and by its callers

    def poll(self) -> int | None:
        """The exit status once the launcher has reported it; -9 for a core whose launcher died
        before reporting (how it ended went with its parent). Never waits."""
        with self._lock:
            if self.returncode is None and _readable(self._pidfd, 0):
                status, alive = self._launcher.take_exit(self.pid, self._generation)
                if status is None and not alive:
                    status = -signal.SIGKILL
                if status is not None:
                    self.returncode = status
                    os.close(self._pidfd)
            return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise subprocess.TimeoutExpired(f"engine core {self.pid}", timeout or 0.0)
            time.sleep(0.01 if left is None else min(0.01, left))
        return self.returncode

    def send_signal(self, sig: int) -> None:
        with self._lock:
            if self.returncode is None:
                try:
                    signal.pidfd_send_signal(self._pidfd, sig)
                except ProcessLookupError:
                    pass  # exited and reaped: its status comes with the next poll

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def __del__(self) -> None:
        if self.returncode is None:  # never seen to exit (poll closes it otherwise): its descriptor, at least
            os.close(self._pidfd)


def _serve(sock: socket.socket) -> None:
    """The launcher's loop: fork a core per request, report each child's exit at once (woken by
    SIGCHLD); leave at the front's end of file."""
    wake_r, wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # a Python handler: the wake-up fd is written
    me = os.getpid()
    children: set[int] = set()
    waiting = select.poll()
    waiting.register(sock.fileno(), select.POLLIN)
    waiting.register(wake_r, select.POLLIN)
    while True:
        ready = {fd for fd, _ in waiting.poll()}
        try:
            if wake_r in ready:  # a byte a signal: one read empties it, and waitpid below finds every exit
                try:
                    os.read(wake_r, 4096)
                except BlockingIOError:
                    pass
            while children:
                pid, status = os.waitpid(-1, os.WNOHANG)
                if pid == 0:
                    break
                children.discard(pid)
                sock.send(pickle.dumps(("exited", pid, os.waitstatus_to_exitcode(status))))  # Popen's form: -signal
            if sock.fileno() not in ready:
                continue
            data, fds, _, _ = socket.recv_fds(sock, _MAX_MESSAGE, 2)
            if not data:
                return  # the front is gone: the children see their parent change and leave too
        except (BrokenPipeError, ConnectionResetError):
            return  # the front is gone
        try:
            request: _Request = pickle.loads(data)
            pid = os.fork()
            if pid == 0:
                sock.close()
                os.close(wake_r)
                os.close(wake_w)
                _run_child(request, fds, me)  # never returns
            pidfd = os.pidfd_open(pid)  # before the next waitpid: the pid is surely the child's
        except Exception as exc:  # this request fails; the launcher and its other cores serve on
            reply, passed = ("failed", f"{type(exc).__name__}: {exc}"), []
        else:
            children.add(pid)
            reply, passed = ("started", pid), [pidfd]
        finally:
            for fd in fds:
                os.close(fd)
        try:
            socket.send_fds(sock, [pickle.dumps(reply)], passed)
        except (BrokenPipeError, ConnectionResetError):
            return
        finally:
            for fd in passed:
                os.close(fd)


def _run_child(request: _Request, fds: list[int], launcher: int) -> None:
    """In the forked child: become the core; leave with os._exit whatever happens (never back into
    the launcher's loop)."""
    code = 1
    try:
        try:
            signal.set_wakeup_fd(-1)
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            os.environ.clear()
            os.environ.update(request.env)
            tempfile.tempdir = None  # read TMPDIR anew: the front's (core_client.py), not the launcher's
            if request.cwd is not None:
                os.chdir(request.cwd)
            if request.cpus:
                os.sched_setaffinity(0, request.cpus)  # before any thread starts: every thread inherits it
            from ruvllm.engine.core_process import run_core

            # The launcher's pid, read before the fork: a launcher that dies before this line still
            # reads as a changed parent.
            run_core(pickle.loads(request.config), request.in_addr, fds[0], fds[1], launcher)
            code = 0
        except SystemExit as exc:
            code = 0 if exc.code is None else exc.code if isinstance(exc.code, int) else 1
        except BaseException:
            import traceback

            traceback.print_exc()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
    finally:
        os._exit(code)


# What every core imports before it loads a model: imported once by the launcher, inherited by each fork.
_PRELOAD = ("msgspec", "zmq", "torch", "ruvllm.messages", "ruvllm.core.engine_core", "ruvllm.worker.worker",
            "ruvllm.engine.core_loop", "ruvllm.engine.core_process")

if __name__ == "__main__":
    import importlib

    from ruvllm.gc_settings import defer_collection, startup_done

    defer_collection()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the group; the front decides
    for _name in _PRELOAD:
        importlib.import_module(_name)
    startup_done()  # the imports frozen: no core's collection walks them (each core's own run_core freezes its load)
    _serve(socket.socket(fileno=int(sys.argv[1])))
