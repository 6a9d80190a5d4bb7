"""The engine core's grammar compiler: each request's constraint compiled by xgrammar against the
model's vocabulary outside the core (the engine loop never waits for a compile; a request waits for
its own), cached by constraint.

Each compile runs in a process of its own, forked for it by one child of the core that has imported
xgrammar and read the vocabulary once (the "zygote", which never compiles: a fork is milliseconds
where a fresh interpreter takes seconds of imports, 10-20 s on a loaded machine). A compile that
passes its deadline, or whose requests all left, is stopped by killing its process; nothing else is
lost with it. A compiled grammar comes back as xgrammar's JSON, unless writing and reading that
would cost more than compiling it again (_worth_sending): then the compile process answers only that
it compiled, and the core compiles the same constraint itself, in its serving thread (xgrammar
releases the interpreter's lock while it compiles), bounded by the time the process just took. One
compile runs at a time; when one has run past `second_after` and another waits, a
second thread takes the waiting ones, so a runaway compile (until its deadline) holds back no other
constraint. Never more than two at once per engine: a third waits while two compile.

The zygote (about 290 MB: xgrammar and torch under it) leaves once no compile has run for `idle_exit`
seconds, and the next new constraint starts another (seconds of imports): compiled constraints are
cached here, in the core, so a server that serves the same few schemas needs it only for the first,
and an engine that met one structured request (a test's, an evaluation's) does not keep it for life."""

from __future__ import annotations

import ctypes
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from concurrent.futures import Future
from multiprocessing.connection import Connection
from typing import Any, Callable

from ruvllm.structured.spec import ByteBudget, StructuredOutputs

_START_TIMEOUT = 300.0  # seconds for the zygote to import xgrammar and read the vocabulary (not a compile's)
_MAX_COMPILES = 2
_POLL_S = 0.1  # how often a thread waiting for its compile looks for constraints waiting behind it
_IDLE = object()  # what the first thread's wait for a job answers once the zygote has been idle too long


class CompileError(ValueError):
    """The request's constraint did not compile (its own fault: the front reports it as a 400)."""


class _Slot:
    """A serving thread and the compile it runs (its process's pid while that is ours to kill)."""

    def __init__(self, first: bool) -> None:
        self.first = first  # the first thread waits for jobs; a second leaves when none waits
        self.running: Future | None = None
        self.since = 0.0  # monotonic time its current compile was taken
        self.pid: int | None = None
        self.stop = False  # abandoned before its process reported its pid
        self.thread: threading.Thread | None = None


class GrammarCompiler:
    def __init__(self, load_tokenizer: Callable[[], Any], vocab_size: int, stop_token_ids: tuple[int, ...],
                 timeout: float = 10.0, cache_size: int = 256, cache_bytes: int = 256 << 20,
                 second_after: float = 1.0, idle_exit: float = 120.0) -> None:
        """idle_exit: seconds without a compile after which the zygote leaves (0: it stays while the
        compiler is open)."""
        self._load_tokenizer: Callable[[], Any] | None = load_tokenizer
        self.vocab_size, self.stop_token_ids = vocab_size, stop_token_ids
        self.timeout = timeout
        # A compile usually takes 0.1 s: one past a second is probably a slow one, worth a second core
        # for the constraints behind it (and not otherwise: the engine's steps share the same cores).
        self.second_after = second_after
        self.idle_exit = idle_exit
        self._last_compile = time.monotonic()  # when the latest compile ended (under _lock)
        self._info: Any = None  # xgrammar's TokenizerInfo, made at the first compile (the tokenizer's load)
        # by constraint: a compile's bytes once done (xgrammar's own count) and its key's
        self.cache: ByteBudget[tuple[str, str], Future] = ByteBudget(cache_bytes, _entry_bytes, cache_size)
        self._lock = threading.Lock()  # the jobs, the slots and what each runs
        self._wake = threading.Condition(self._lock)
        self._jobs: deque[tuple[StructuredOutputs, Future]] = deque()
        self._slots: list[_Slot] = []
        self._closed = False
        self._zygote_lock = threading.Lock()  # its start (seconds) and each fork request
        self._zygote: subprocess.Popen | None = None
        self._starting: subprocess.Popen | None = None  # a zygote still loading (close kills it)
        self._control: socket.socket | None = None
        with self._lock:
            self._add_slot()

    def submit(self, spec: StructuredOutputs) -> Future:
        """A future of the compiled grammar; the same one for every request with the same constraint."""
        with self.cache.lock:
            fut = self.cache.get(spec.key)
            if fut is None or fut.cancelled() or (fut.done() and fut.exception() is not None):
                fut = Future()
                self.cache.put(spec.key, fut)
                with self._wake:
                    self._jobs.append((spec, fut))
                    self._wake.notify()
            return fut

    def abandon(self, fut: Future) -> None:
        """No request waits for this compile any more: dropped if not started, stopped if running."""
        with self._lock:
            if fut.cancel():
                self._jobs = deque(job for job in self._jobs if job[1] is not fut)
                return
            for slot in self._slots:
                if slot.running is fut:
                    slot.stop = True  # its process is killed as soon as it has one
                    self._kill(slot)  # its thread sees the socket close and ends the future

    def close(self) -> None:
        with self._wake:
            self._closed = True
            self._wake.notify_all()
            for _, fut in self._jobs:
                fut.cancel()
            for slot in self._slots:
                self._kill(slot)
            zygotes = [z for z in (self._zygote, self._starting) if z is not None]
            threads = [slot.thread for slot in self._slots if slot.thread is not None]
        for zygote in zygotes:  # its forks die with it (PR_SET_PDEATHSIG)
            zygote.kill()
        if self._zygote_lock.acquire(timeout=5):  # else a start holds it: it sees the kill and reaps
            try:
                self._stop_zygote()
            finally:
                self._zygote_lock.release()
        # The serving threads see the close and end: waited for, so that none is still running (a
        # daemon thread) while the interpreter exits.
        for thread in threads:
            if thread is not threading.current_thread():
                thread.join(timeout=5)

    # --- the serving threads -----------------------------------------------------------------------
    def _add_slot(self) -> None:
        """Under the lock: a serving thread."""
        slot = _Slot(first=not self._slots)
        self._slots.append(slot)
        slot.thread = threading.Thread(target=self._serve, args=(slot,), name=f"ruvllm-grammar-{len(self._slots)}",
                                       daemon=True)
        slot.thread.start()

    def _serve(self, slot: _Slot) -> None:
        while True:
            with self._wake:
                job = self._take(slot)
                if job is None:  # closed, or a second thread with nothing left to do
                    self._slots.remove(slot)
                    return
                if job is not _IDLE:
                    slot.running, slot.since, slot.stop = job[1], time.monotonic(), False
            if job is _IDLE:
                self._stop_idle_zygote()
                continue
            spec, fut = job
            try:
                fut.set_result(self._compile(slot, spec))
            except BaseException as exc:  # noqa: BLE001  # the request's failure, not this thread's
                fut.set_exception(exc)
            with self._wake:
                slot.running = None
                self._last_compile = time.monotonic()
                self._wake.notify_all()  # the first thread, waiting, times the zygote's idleness from now
            self.cache.trim()  # its size is known now

    def _take(self, slot: _Slot) -> Any:
        """Under the lock: the next job still wanted, or None (closed; a second thread finds none), or
        _IDLE (the first thread: the zygote has had no compile for idle_exit seconds)."""
        while not self._closed:
            while self._jobs:
                spec, fut = self._jobs.popleft()
                if fut.set_running_or_notify_cancel():
                    return spec, fut
            if not slot.first:
                return None
            idle_left = self._idle_left()
            if idle_left is not None and idle_left <= 0:
                return _IDLE
            self._wake.wait(idle_left)
        return None

    def _idle_left(self) -> float | None:
        """Under the lock: seconds until the zygote has been idle for idle_exit; None when there is no
        zygote to stop (or it stays), or a compile runs."""
        if not self.idle_exit > 0 or self._zygote is None or any(s.running is not None for s in self._slots):
            return None
        return self._last_compile + self.idle_exit - time.monotonic()

    def _stop_idle_zygote(self) -> None:
        """The zygote leaves, unless a compile came meanwhile: each fork is asked for under
        _zygote_lock, held here, and a compile is marked running (under _lock) before it asks."""
        with self._zygote_lock:
            with self._lock:
                idle_left = self._idle_left()
                if self._jobs or self._closed or idle_left is None or idle_left > 0:
                    return
            self._stop_zygote()

    def _more_help(self, slot: _Slot) -> None:
        """Called while `slot` compiles: a second thread when this compile is slow and others wait."""
        with self._lock:
            if (len(self._slots) < _MAX_COMPILES and not self._closed
                    and time.monotonic() - slot.since > self.second_after
                    and any(not fut.cancelled() for _, fut in self._jobs)):
                self._add_slot()

    def _kill(self, slot: _Slot) -> None:
        """Under the lock. The pid is still its compile's: that process waits, after its answer, until
        its socket closes (which happens after slot.pid is cleared), so no other process has it."""
        if slot.pid is not None:
            try:
                os.kill(slot.pid, signal.SIGKILL)
            except ProcessLookupError:  # killed from outside meanwhile
                pass
            slot.pid = None

    def _compile(self, slot: _Slot, spec: StructuredOutputs) -> Any:
        import xgrammar as xgr

        with self._zygote_lock:
            if self._info is None:
                self._info = xgr.TokenizerInfo.from_huggingface(self._load_tokenizer(), vocab_size=self.vocab_size,
                                                                stop_token_ids=list(self.stop_token_ids))
                # The loader (the worker's method) is let go: this compiler's threads must never be
                # the last to hold the model. Its weights are tensors over numpy arrays, whose
                # release takes the GIL back; on a daemon thread as the interpreter exits, that
                # aborts the process ("terminate called without an active exception").
                self._load_tokenizer = None
            conn = self._fork()
        try:
            try:
                if not conn.poll(_START_TIMEOUT):
                    raise EOFError
                pid = int(conn.recv_bytes())
            except (EOFError, OSError):  # the zygote died before forking, or the fork was killed
                raise RuntimeError("the grammar compiler process did not start") from None
            with self._lock:
                slot.pid = pid
                if slot.stop:  # abandoned while it forked
                    self._kill(slot)
            conn.send_bytes(json.dumps(spec.ebnf_or_source()).encode())
            deadline = time.monotonic() + self.timeout
            while not conn.poll(min(_POLL_S, max(0.0, deadline - time.monotonic()))):
                if time.monotonic() >= deadline:
                    with self._lock:
                        self._kill(slot)
                    raise CompileError(f"the output constraint did not compile within {self.timeout:g} s "
                                       "(grammar_compile_timeout); it was stopped")
                self._more_help(slot)
            try:
                ok, text = json.loads(conn.recv_bytes())
            except (EOFError, OSError):  # killed: its requests left (abandon)
                raise CompileError("the grammar compile was stopped") from None
        finally:
            with self._lock:
                slot.pid = None
            conn.close()  # the compile's process leaves now (if it was not killed)
        if not ok:
            raise CompileError(text)
        if text is None:  # compiled there within its deadline, cheaper to compile again than to send
            from ruvllm.structured.spec import _grammar

            compiler = xgr.GrammarCompiler(self._info, max_threads=1, cache_enabled=False)
            return compiler.compile_grammar(_grammar(*spec.ebnf_or_source()))
        return xgr.CompiledGrammar.deserialize_json(text, self._info)

    # --- the zygote (under _zygote_lock) -----------------------------------------------------------
    def _fork(self) -> Connection:
        """A socket to a fresh compile process; the zygote is started first if it is not running."""
        for attempt in range(2):
            if self._closed:
                raise RuntimeError("the grammar compiler is closed")
            if self._zygote is None or self._zygote.poll() is not None:
                self._start_zygote()
            assert self._control is not None
            ours, theirs = socket.socketpair()
            try:
                socket.send_fds(self._control, [b"f"], [theirs.fileno()])
                return Connection(ours.detach())
            except OSError:  # it died since (killed from outside, out of memory): once more with a new one
                ours.close()
                self._stop_zygote()
                if attempt:
                    raise RuntimeError("the grammar compiler process is not running") from None
            finally:
                theirs.close()
        raise AssertionError("unreachable")

    def _start_zygote(self) -> None:
        self._stop_zygote()
        ours, theirs = socket.socketpair()
        with theirs:
            # stdout to stderr: nothing a library prints can reach the protocol or the core's stdout
            zygote = subprocess.Popen([sys.executable, "-m", "ruvllm.structured.compiler", str(theirs.fileno())],
                                      stdin=subprocess.DEVNULL, stdout=2, pass_fds=[theirs.fileno()])
        with self._lock:
            self._starting = zygote
            closed = self._closed
        framed = Connection(os.dup(ours.fileno()))
        try:
            if closed:
                raise EOFError
            framed.send_bytes(self._info.serialize_json().encode())
            if not framed.poll(_START_TIMEOUT) or framed.recv_bytes() != b"ready":
                raise EOFError
        except (EOFError, OSError):
            zygote.kill()
            zygote.wait()
            ours.close()
            raise RuntimeError("the grammar compiler process did not start") from None
        finally:
            framed.close()
            with self._lock:
                self._starting = None
        self._zygote, self._control = zygote, ours

    def _stop_zygote(self) -> None:
        zygote, control, self._zygote, self._control = self._zygote, self._control, None, None
        if zygote is not None:
            zygote.kill()
            zygote.wait()
        if control is not None:
            control.close()


def _entry_bytes(key: tuple[str, str], fut: Future) -> int:
    done = fut.done() and not fut.cancelled() and fut.exception() is None
    return len(key[1]) + (fut.result().memory_size_bytes if done else 0)


_PR_SET_PDEATHSIG = 1


def _child_main(control_fd: int) -> None:
    """The zygote: reads the vocabulary, says ready, then forks a compile process for each socket the
    core sends it, until the core's end closes. It never compiles, so it never needs to be killed."""
    from ruvllm.gc_settings import defer_collection, startup_done

    defer_collection()
    control = socket.socket(fileno=control_fd)
    framed = Connection(os.dup(control_fd))
    import xgrammar as xgr

    from ruvllm.structured.spec import _grammar  # imported once here, not in each fork

    try:
        vocabulary = framed.recv_bytes().decode()
    except (EOFError, OSError):  # the core left (or closed) while this started
        return
    compiler = xgr.GrammarCompiler(xgr.TokenizerInfo.deserialize_json(vocabulary), max_threads=1, cache_enabled=False)
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # its forks are reaped as they end
    framed.send_bytes(b"ready")
    startup_done()  # (after ready: the core goes on meanwhile) each fork inherits the imports frozen
    framed.close()
    me = os.getpid()
    while True:
        try:
            _, fds, _, _ = socket.recv_fds(control, 1, 1)
        except OSError:
            return
        if not fds:  # the core closed its end: it is gone or closing
            return
        if os.fork() == 0:
            try:
                _die_with_parent()
                if os.getppid() == me:  # else the zygote died before that took hold
                    control.close()
                    _compile_one(Connection(fds[0]), lambda kind, text: compiler.compile_grammar(_grammar(kind, text)))
            finally:
                os._exit(0)
        os.close(fds[0])


def _die_with_parent() -> None:
    """A compile process ends with the zygote (so with the core: the zygote leaves when the core's
    end of its socket closes), even mid-compile, where it reads nothing. Linux only (prctl)."""
    prctl = getattr(ctypes.CDLL(None), "prctl", None)
    if prctl is not None:
        prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def _worth_sending(compile_seconds: float, memory_bytes: int) -> bool:
    """Whether a compiled grammar is cheaper to send back as xgrammar's JSON than to compile again.
    Writing and reading that JSON grows faster than the grammar: a power law through three measured
    grammars (1.2, 4.4, 14.7 MB; the default model's vocabulary, one thread, session 30) puts it at
    ~0.13 s x (its size in MB)^1.75 of CPU, where a compile's own time varies by constraint.
    Measured: a 200-field patterned schema (14.7 MB) compiled in 4.6 s, its JSON (144 MB) took 9.3 s
    to write and 4.9 s to read; a typical schema of the tests' random ones (~1.2 MB) 0.05-0.6 s to
    compile, 0.1-0.4 s to send."""
    return compile_seconds >= 0.13 * (memory_bytes / 1e6) ** 1.75


def _compile_one(conn: Connection, compile_grammar: Callable[[str, str], Any]) -> None:
    """A forked compile process: its pid, then the answer to one (kind, text): the compiled grammar's
    JSON, or None where the core had better compile it again (_worth_sending); then it waits until
    the core closes the socket, so its pid stays its own until the core no longer kills by it."""
    try:
        conn.send_bytes(str(os.getpid()).encode())
        kind, text = json.loads(conn.recv_bytes())
        try:
            started = time.process_time()
            grammar = compile_grammar(kind, text)
            spent = time.process_time() - started
            reply = [True, grammar.serialize_json() if _worth_sending(spent, grammar.memory_size_bytes) else None]
        except Exception as exc:  # noqa: BLE001  # xgrammar's kinds; the request is told
            reply = [False, f"the output constraint did not compile: {str(exc).strip() or type(exc).__name__}"]
        conn.send_bytes(json.dumps(reply).encode())
        conn.recv_bytes()
    except (EOFError, OSError):  # the core closed the socket: nobody waits
        pass


if __name__ == "__main__":
    _child_main(int(sys.argv[1]))
