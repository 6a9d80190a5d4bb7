"""A parent for engine cores that has already imported torch and the engine: cores fork from it.

A core started as a fresh interpreter (`python -m ruvllm.engine.core_process`) spends most of its
start importing: on the 2-core AVX2 EPYC a default-model core was ready 3.5-4.1 s after its start,
and importing torch and the engine's modules alone took 3.7 s (docs/benchmarks.md, session 24). A
front that starts several cores over its life (data-parallel replicas and their restarts, a
many-models server loading and unloading models) starts this launcher once: one interpreter that
imports those modules and then only forks, never computes, so each child starts with them imported
and without threads, CUDA state or locks held (the launcher starts none of them). A front that
starts one core (`ruvllm serve`, `LLM(process=True)`) spawns it directly: a launcher would cost the
same imports once more.

The front and the launcher talk over a Unix SEQPACKET socket pair: the front sends a request (the
pickled config, the core's arguments, its environment, working folder and CPUs) with the core's two
inherited descriptors (its socket end and doorbell) as SCM_RIGHTS; the launcher forks, answers the
child's pid, and later reports each child's exit status, which only it (the parent) can read.
`LaunchedCore` is the front's handle with Popen's interface (pid, poll, wait, terminate, kill,
returncode), signalling through a pidfd, so a signal never reaches a reused pid. The children's
parent is the launcher: a core leaves when its parent changes (core_process.py), and the launcher
leaves when the front's end of the socket closes, so a killed front leaves no core behind.
"""

from __future__ import annotations

import os
import pickle
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any

_MAX_MESSAGE = 1 << 20  # a request: a pickled EngineConfig and the front's environment
_REAP_POLL_S = 0.2  # how often the launcher reaps children while no request comes


@dataclass
class _Request:
    config: bytes  # the pickled EngineConfig
    in_addr: str  # the front's command socket (ZeroMQ)
    env: dict[str, str]
    cwd: str
    cpus: set[int] | None


class CoreLauncher:
    """The launcher process, started by the constructor; `launch` forks a core from it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()  # one conversation with the launcher at a time
        self._exits: dict[int, int] = {}  # pid -> exit status, as the launcher reported them
        self._proc: subprocess.Popen | None = None
        self._sock: socket.socket | None = None
        self._start()

    def _start(self) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            self._proc = subprocess.Popen([sys.executable, "-m", "ruvllm.engine.core_launcher", str(theirs.fileno())],
                                          pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL)
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        self._sock = ours

    @property
    def pid(self) -> int:
        assert self._proc is not None
        return self._proc.pid

    def launch(self, config: Any, in_addr: str, fds: tuple[int, int], env: dict[str, str],
               cpus: set[int] | None) -> LaunchedCore:
        """A core forked from the launcher, running `core_process.run_core(config, in_addr, *fds, ...)`
        with `env` as its environment, this process's working folder, and `cpus` as its affinity."""
        request = _Request(pickle.dumps(config), in_addr, env, os.getcwd(), cpus)
        with self._lock:
            if self._sock is None or (self._proc is not None and self._proc.poll() is not None):
                self._close_locked()
                self._start()  # the launcher died (killed): a new one, as a restart would need
            assert self._sock is not None
            socket.send_fds(self._sock, [pickle.dumps(request)], list(fds))
            while True:
                message = self._read_locked(None)
                if message is None:
                    raise OSError("the engine core launcher exited before starting the core")
                if message[0] == "started":
                    return LaunchedCore(self, message[1])

    def _read_locked(self, timeout: float | None) -> tuple | None:
        """One message, recording an exit report; None at the launcher's end of file or after
        `timeout` seconds without one (0: only what is there)."""
        assert self._sock is not None
        ready, _, _ = select.select([self._sock], [], [], timeout)
        if not ready:
            return ("timeout",)
        data = self._sock.recv(_MAX_MESSAGE)
        if not data:
            return None
        message = pickle.loads(data)
        if message[0] == "exited":
            self._exits[message[1]] = message[2]
        return message

    def _collect(self, timeout: float) -> bool:
        """Read exit reports for up to `timeout` seconds; False once the launcher has gone."""
        deadline = time.monotonic() + timeout
        with self._lock:
            while self._sock is not None:
                message = self._read_locked(max(0.0, deadline - time.monotonic()))
                if message is None:
                    self._close_locked()
                    return False
                if message[0] == "timeout" or message[0] == "exited":
                    return True
            return False

    def exit_status(self, pid: int) -> int | None:
        return self._exits.get(pid)

    def close(self) -> None:
        """Stop the launcher (its children, if any are left, see their parent change and leave)."""
        with self._lock:
            self._close_locked()

    def _close_locked(self) -> None:
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
    """A core forked by a CoreLauncher, with the part of Popen's interface the core's client uses."""

    def __init__(self, launcher: CoreLauncher, pid: int) -> None:
        self._launcher = launcher
        self.pid = pid
        # A pidfd: signals reach this process and no other, even once its pid is reaped and reused;
        # readable once it has exited, whether or not the launcher is there to say how.
        self._pidfd = os.pidfd_open(pid)
        self.returncode: int | None = None
        self._lock = threading.Lock()  # polled by the client's receiving thread and by its callers

    def poll(self) -> int | None:
        with self._lock:
            if self.returncode is None:
                self._poll_locked()
            return self.returncode

    def _poll_locked(self) -> None:
        status = self._launcher.exit_status(self.pid)
        if status is None and self._exited():
            # Gone: how it ended is the launcher's (its parent's) to say, within a reaping poll.
            deadline = time.monotonic() + 2.0
            while status is None and time.monotonic() < deadline and self._launcher._collect(_REAP_POLL_S):
                status = self._launcher.exit_status(self.pid)
            if status is None:
                status = -signal.SIGKILL  # the launcher is gone too: unknown, and reported as killed
        if status is not None:
            self.returncode = status
            os.close(self._pidfd)

    def _exited(self) -> bool:
        ready, _, _ = select.select([self._pidfd], [], [], 0)
        return bool(ready)

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise subprocess.TimeoutExpired(f"engine core {self.pid}", timeout or 0.0)
            time.sleep(0.02 if left is None else min(0.02, left))
        return self.returncode

    def send_signal(self, sig: int) -> None:
        with self._lock:
            if self.returncode is not None:
                return
            try:
                signal.pidfd_send_signal(self._pidfd, sig)
            except ProcessLookupError:
                pass  # exited meanwhile: its status comes with the next poll

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def _exit_status(status: int) -> int:
    """A wait status as Popen's returncode: the exit code, or minus the signal that ended it."""
    return -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)


def _serve(sock: socket.socket) -> None:
    """The launcher's loop: fork a core per request, report each child's exit; leave at end of file."""
    children: set[int] = set()
    while True:
        ready, _, _ = select.select([sock], [], [], _REAP_POLL_S)
        try:
            while children:
                pid, status = os.waitpid(-1, os.WNOHANG)
                if pid == 0:
                    break
                children.discard(pid)
                sock.send(pickle.dumps(("exited", pid, _exit_status(status))))
            if not ready:
                continue
            data, fds, _, _ = socket.recv_fds(sock, _MAX_MESSAGE, 2)
            if not data:
                return  # the front is gone: the children see their parent change and leave too
            request: _Request = pickle.loads(data)
            pid = os.fork()
            if pid == 0:
                sock.close()
                _run_child(request, fds)  # never returns
            for fd in fds:
                os.close(fd)
            children.add(pid)
            sock.send(pickle.dumps(("started", pid)))
        except (BrokenPipeError, ConnectionResetError):
            return  # the front is gone


def _run_child(request: _Request, fds: list[int]) -> None:
    code = 1
    try:
        os.environ.clear()
        os.environ.update(request.env)
        os.chdir(request.cwd)
        if request.cpus:
            os.sched_setaffinity(0, request.cpus)  # before any thread starts: every thread inherits it
        import torch

        torch.seed()  # a fresh process's generator state, not a copy of the launcher's
        from ruvllm.engine.core_process import run_core

        run_core(pickle.loads(request.config), request.in_addr, fds[0], fds[1], os.getppid())
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:
        import traceback

        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


# What every core imports before it loads a model: imported once by the launcher, inherited by each fork.
_PRELOAD = ("msgspec", "zmq", "torch", "ruvllm.messages", "ruvllm.core.engine_core", "ruvllm.worker.worker",
            "ruvllm.engine.core_loop", "ruvllm.engine.core_process")

if __name__ == "__main__":
    import importlib

    for _name in _PRELOAD:
        importlib.import_module(_name)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the group; the front decides
    _serve(socket.socket(fileno=int(sys.argv[1])))
