"""The engine core's grammar compiler: each request's constraint compiled by xgrammar against the
model's vocabulary in a child process (the engine loop never waits for a compile; a request waits for
its own), one at a time, cached by constraint. A compile that passes its deadline, or whose requests
all left, is stopped by killing the child; the next compile starts a fresh one."""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import threading
from concurrent.futures import Future
from multiprocessing.connection import Connection
from typing import Any, Callable

from ruvllm.structured.spec import ByteBudget, StructuredOutputs

_START_TIMEOUT = 300.0  # seconds for a child to import xgrammar and read the vocabulary (not a compile's)


class CompileError(ValueError):
    """The request's constraint did not compile (its own fault: the front reports it as a 400)."""


class GrammarCompiler:
    def __init__(self, load_tokenizer: Callable[[], Any], vocab_size: int, stop_token_ids: tuple[int, ...],
                 timeout: float = 10.0, cache_size: int = 256, cache_bytes: int = 256 << 20) -> None:
        self._load_tokenizer, self.vocab_size, self.stop_token_ids = load_tokenizer, vocab_size, stop_token_ids
        self.timeout = timeout
        self._info: Any = None  # xgrammar's TokenizerInfo, made at the first compile (the tokenizer's load)
        # by constraint: a compile's bytes once done (xgrammar's own count) and its key's
        self.cache: ByteBudget[tuple[str, str], Future] = ByteBudget(cache_bytes, _entry_bytes, cache_size)
        self._jobs: queue.Queue[tuple[StructuredOutputs, Future]] = queue.Queue()
        self._child: subprocess.Popen | None = None
        self._conns: tuple[Connection, Connection] | None = None
        self._running: Future | None = None
        self._lock = threading.Lock()
        threading.Thread(target=self._serve, name="ruvllm-grammar", daemon=True).start()

    def submit(self, spec: StructuredOutputs) -> Future:
        """A future of the compiled grammar; the same one for every request with the same constraint."""
        with self.cache.lock:
            fut = self.cache.get(spec.key)
            if fut is None or fut.cancelled() or (fut.done() and fut.exception() is not None):
                fut = Future()
                self.cache.put(spec.key, fut)
                self._jobs.put((spec, fut))
            return fut

    def abandon(self, fut: Future) -> None:
        """No request waits for this compile any more: dropped if not started, stopped if running."""
        with self._lock:
            if not fut.cancel() and fut is self._running and self._child is not None:
                self._child.kill()  # the serving thread sees the pipe close and ends the future

    def close(self) -> None:
        with self._lock:
            if self._child is not None:
                self._child.kill()

    # --- the serving thread ----------------------------------------------------------------------
    def _serve(self) -> None:
        while True:
            spec, fut = self._jobs.get()
            with self._lock:
                if not fut.set_running_or_notify_cancel():
                    continue
                self._running = fut
            try:
                fut.set_result(self._compile(spec))
            except BaseException as exc:  # noqa: BLE001  # the request's failure, not this thread's
                fut.set_exception(exc)
            with self._lock:
                self._running = None
            self.cache.trim()  # its size is known now

    def _compile(self, spec: StructuredOutputs) -> Any:
        import xgrammar as xgr

        if self._info is None:
            self._info = xgr.TokenizerInfo.from_huggingface(self._load_tokenizer(), vocab_size=self.vocab_size,
                                                            stop_token_ids=list(self.stop_token_ids))
        send, receive = self._conns if self._child is not None and self._child.poll() is None else self._start()
        send.send_bytes(json.dumps(spec.ebnf_or_source()).encode())
        if not receive.poll(self.timeout):
            self._stop()
            raise CompileError(f"the output constraint did not compile within {self.timeout:g} s "
                               "(grammar_compile_timeout); it was stopped")
        try:
            ok, text = json.loads(receive.recv_bytes())
        except (EOFError, OSError):  # killed: its requests left (abandon)
            self._stop()
            raise CompileError("the grammar compile was stopped") from None
        if not ok:
            raise CompileError(text)
        return xgr.CompiledGrammar.deserialize_json(text, self._info)

    def _start(self) -> tuple[Connection, Connection]:
        self._stop()
        child = subprocess.Popen([sys.executable, "-m", "ruvllm.structured.compiler"], stdin=subprocess.PIPE,
                                 stdout=subprocess.PIPE)
        assert child.stdin is not None and child.stdout is not None
        conns = Connection(os.dup(child.stdin.fileno()), readable=False), Connection(os.dup(child.stdout.fileno()),
                                                                                      writable=False)
        child.stdin.close()
        child.stdout.close()
        conns[0].send_bytes(self._info.serialize_json().encode())
        if not conns[1].poll(_START_TIMEOUT) or conns[1].recv_bytes() != b"ready":
            child.kill()
            raise RuntimeError("the grammar compiler process did not start")
        with self._lock:
            self._child, self._conns = child, conns
        return conns

    def _stop(self) -> None:
        with self._lock:
            child, conns, self._child, self._conns = self._child, self._conns, None, None
        if child is not None:
            child.kill()
            child.wait()
            for conn in conns or ():
                conn.close()


def _entry_bytes(key: tuple[str, str], fut: Future) -> int:
    done = fut.done() and not fut.cancelled() and fut.exception() is None
    return len(key[1]) + (fut.result().memory_size_bytes if done else 0)


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
            reply = [True, compiler.compile_grammar(_grammar(kind, text)).serialize_json()]
        except Exception as exc:  # noqa: BLE001  # xgrammar's kinds; the request is told
            reply = [False, f"the output constraint did not compile: {str(exc).strip() or type(exc).__name__}"]
        out.send_bytes(json.dumps(reply).encode())


if __name__ == "__main__":
    _child_main()
