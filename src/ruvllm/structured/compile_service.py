"""The process's grammar compiles: one thread runs them one at a time, each in an xgrammar child
process for its vocabulary, which every engine of this process compiling against that vocabulary
shares. A child costs ~290 MB and 3-10 s of CPU to start (it imports xgrammar, which imports torch
and transformers, and reads the vocabulary); tests, notebooks and `LLM.with_settings` run several
engines in one process, and a child each made them accumulate. `ruvllm serve` runs one engine per
process, so it sees no difference.

A compile that passes its engine's deadline, or whose requests all left, is stopped by killing the
child; the next compile starts a fresh one. A child ends when the last engine that compiled against
its vocabulary closes (and when this process ends: its pipe closes)."""

from __future__ import annotations

import dataclasses
import json
import os
import queue
import subprocess
import sys
import threading
from concurrent.futures import Future
from multiprocessing.connection import Connection
from typing import Any, Protocol

from ruvllm.structured.spec import StructuredOutputs

_START_TIMEOUT = 300.0  # seconds for a child to import xgrammar and read the vocabulary (not a compile's)
# A reply's first byte: the rest is the compiled grammar's JSON (sent as it is: a large schema's runs
# to tens of MB, which a JSON string around it would escape and parse once more), or the reason.
_DONE, _FAILED = b"\x01", b"\x00"


class CompileError(ValueError):
    """The request's constraint did not compile (its own fault: the front reports it as a 400)."""


@dataclasses.dataclass(frozen=True)
class Vocabulary:
    """What a child compiles against: xgrammar's TokenizerInfo (compiled grammars are read back
    against it), its serialized form (what the child is fed) and that form's digest (which child)."""

    info: Any
    text: bytes
    key: str


class Owner(Protocol):
    """An engine's side of its compiles (compiler.GrammarCompiler)."""

    timeout: float  # seconds one compile may take, once sent to the child
    closed: bool

    def vocabulary(self) -> Vocabulary: ...  # made in the compile thread, at the owner's first compile

    def compiled(self) -> None: ...  # after each of its compiles, done or failed


@dataclasses.dataclass(eq=False)
class Job:
    spec: StructuredOutputs
    future: Future
    owner: Owner
    abandoned: bool = False  # its requests left while it ran: stopped once its child is up


class _Child:
    """One xgrammar child: fed the vocabulary once, then one constraint at a time. The protocol runs
    on its own copies of the pipes' descriptors (multiprocessing's length-prefixed messages)."""

    def __init__(self, vocab: Vocabulary) -> None:
        self.process = subprocess.Popen([sys.executable, "-m", "ruvllm.structured.compile_service"],
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        assert self.process.stdin is not None and self.process.stdout is not None
        self.send = Connection(os.dup(self.process.stdin.fileno()), readable=False)
        self.receive = Connection(os.dup(self.process.stdout.fileno()), writable=False)
        self.process.stdin.close()
        self.process.stdout.close()
        self.send.send_bytes(vocab.text)
        if not self.receive.poll(_START_TIMEOUT) or self.receive.recv_bytes() != b"ready":
            self.close()
            raise RuntimeError("the grammar compiler process did not start")

    @property
    def alive(self) -> bool:
        return self.process.poll() is None

    def close(self) -> None:
        self.process.kill()
        self.process.wait()
        self.send.close()
        self.receive.close()


class CompileService:
    def __init__(self) -> None:
        self._jobs: queue.Queue[Job] = queue.Queue()
        self._lock = threading.Lock()
        self._children: dict[str, _Child] = {}  # by vocabulary key
        self._users: dict[str, set[Owner]] = {}  # the open owners that compiled against each vocabulary
        self._running: Job | None = None
        self._running_child: _Child | None = None  # the child the running job was sent to
        self._thread: threading.Thread | None = None  # started at the first compile

    def submit(self, job: Job) -> None:
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._serve, name="ruvllm-grammar", daemon=True)
                self._thread.start()
        self._jobs.put(job)

    def abandon(self, fut: Future) -> None:
        """No request waits for this compile any more: dropped if not started, stopped if running."""
        with self._lock:
            if fut.cancel() or self._running is None or self._running.future is not fut:
                return
            self._running.abandoned = True
            if self._running_child is not None:
                self._running_child.process.kill()  # the serving thread sees the pipe close and ends the future

    def leave(self, owner: Owner) -> None:
        """`owner` closed (its queued compiles already cancelled): its running compile is stopped, and
        each child no other open owner uses ends."""
        with self._lock:
            if self._running is not None and self._running.owner is owner:
                self._running.abandoned = True
                if self._running_child is not None:
                    self._running_child.process.kill()
            for key, users in list(self._users.items()):
                users.discard(owner)
                if not users:
                    del self._users[key]
                    child = self._children.pop(key, None)
                    if child is not None:
                        child.process.kill()  # reaped by whoever next touches it, or at once below
                        if child is not self._running_child:
                            child.close()

    def child(self, key: str) -> subprocess.Popen | None:
        """The child process compiling against vocabulary `key` (None between children)."""
        with self._lock:
            child = self._children.get(key)
            return None if child is None else child.process

    def running(self, owner: Owner) -> Future | None:
        """The future of the compile running now, if it is one of `owner`'s."""
        with self._lock:
            job = self._running
            return job.future if job is not None and job.owner is owner else None

    # --- the serving thread ----------------------------------------------------------------------
    def _serve(self) -> None:
        while True:
            job = self._jobs.get()
            with self._lock:
                if not job.future.set_running_or_notify_cancel():
                    continue
                self._running = job
            try:
                job.future.set_result(self._compile(job))
            except BaseException as exc:  # noqa: BLE001  # the request's failure, not this thread's
                job.future.set_exception(exc)
            with self._lock:
                self._running, self._running_child = None, None
            job.owner.compiled()

    def _compile(self, job: Job) -> Any:
        import xgrammar as xgr

        vocab = job.owner.vocabulary()
        child = self._child_for(job, vocab)
        try:
            child.send.send_bytes(json.dumps(job.spec.ebnf_or_source()).encode())
            if not child.receive.poll(job.owner.timeout):
                self._stop(vocab.key, child)
                raise CompileError(f"the output constraint did not compile within {job.owner.timeout:g} s "
                                   "(grammar_compile_timeout); it was stopped")
            reply = child.receive.recv_bytes()
        except (EOFError, OSError):  # killed: its requests left (abandon), or its engine closed
            self._stop(vocab.key, child)
            raise CompileError("the grammar compile was stopped") from None
        if reply[:1] != _DONE:
            raise CompileError(reply[1:].decode())
        return xgr.CompiledGrammar.deserialize_json(reply[1:].decode(), vocab.info)

    def _child_for(self, job: Job, vocab: Vocabulary) -> _Child:
        """The vocabulary's child, started if there is none (outside the lock: it takes seconds)."""
        with self._lock:
            if job.owner.closed:
                raise CompileError("the grammar compile was stopped: its engine closed")
            self._users.setdefault(vocab.key, set()).add(job.owner)
            child = self._children.get(vocab.key)
        if child is not None and not child.alive:  # killed at a deadline or an abandon: replaced
            self._stop(vocab.key, child)
            child = None
        if child is None:
            child = _Child(vocab)
            with self._lock:
                kept = vocab.key in self._users  # not when every engine using it closed meanwhile
                if kept:
                    self._children[vocab.key] = child
            if not kept:
                child.close()
                raise CompileError("the grammar compile was stopped: its engine closed")
        with self._lock:
            if job.abandoned:  # its requests left while the child started: the child stays for the next
                raise CompileError("the grammar compile was stopped")
            self._running_child = child
        return child

    def _stop(self, key: str, child: _Child) -> None:
        with self._lock:
            if self._children.get(key) is child:
                del self._children[key]
        child.close()


# The process's one compile service: what lets engines in one process share a child (module docs).
PROCESS_SERVICE = CompileService()


def _child_main() -> None:
    """The child: reads the vocabulary, then compiles (kind, text) after (kind, text) until its pipe
    closes; protocol on its own copy of stdout (fd 1 goes to stderr: nothing a library prints can
    break it)."""
    out = Connection(os.dup(1), readable=False)
    os.dup2(2, 1)
    inp = Connection(os.dup(0), writable=False)
    import xgrammar as xgr

    from ruvllm.structured.spec import _grammar

    compiler = xgr.GrammarCompiler(xgr.TokenizerInfo.deserialize_json(inp.recv_bytes().decode()), max_threads=1,
                                   cache_enabled=False)
    out.send_bytes(b"ready")
    while True:
        try:
            kind, text = json.loads(inp.recv_bytes())
        except EOFError:
            return
        try:
            reply = _DONE + compiler.compile_grammar(_grammar(kind, text)).serialize_json().encode()
        except Exception as exc:  # noqa: BLE001  # xgrammar's kinds; the request is told
            reply = _FAILED + (f"the output constraint did not compile: "
                               f"{str(exc).strip() or type(exc).__name__}").encode()
        out.send_bytes(reply)


if __name__ == "__main__":
    _child_main()
