"""The engine core's grammar compiler: each request's constraint compiled by xgrammar against the
model's vocabulary in a child process (the engine loop never waits for a compile; a request waits for
its own), cached by constraint, each compile bounded by this engine's deadline. The compiles
themselves run in the process's CompileService (structured/compile_service.py): one at a time, in a
child shared by the engines of this process that compile against the same vocabulary."""

from __future__ import annotations

import hashlib
import threading
from concurrent.futures import Future
from subprocess import Popen
from typing import Any, Callable

from ruvllm.structured.compile_service import PROCESS_SERVICE, CompileError, CompileService, Job, Vocabulary
from ruvllm.structured.spec import ByteBudget, StructuredOutputs

__all__ = ["CompileError", "GrammarCompiler"]


class GrammarCompiler:
    def __init__(self, load_tokenizer: Callable[[], Any], vocab_size: int, stop_token_ids: tuple[int, ...],
                 timeout: float = 10.0, cache_size: int = 256, cache_bytes: int = 256 << 20,
                 service: CompileService = PROCESS_SERVICE) -> None:
        self._load_tokenizer, self.vocab_size, self.stop_token_ids = load_tokenizer, vocab_size, stop_token_ids
        self.timeout = timeout  # seconds, counted from the constraint's arrival in the child
        self.service = service
        self.closed = False
        self._vocab: Vocabulary | None = None  # made at the first compile (the tokenizer's load)
        self._vocab_lock = threading.Lock()
        # by constraint: a compile's bytes once done (xgrammar's own count) and its key's
        self.cache: ByteBudget[tuple[str, str], Future] = ByteBudget(cache_bytes, _entry_bytes, cache_size)

    def submit(self, spec: StructuredOutputs) -> Future:
        """A future of the compiled grammar; the same one for every request with the same constraint."""
        with self.cache.lock:
            fut = self.cache.get(spec.key)
            if fut is None or fut.cancelled() or (fut.done() and fut.exception() is not None):
                fut = Future()
                self.cache.put(spec.key, fut)
                self.service.submit(Job(spec, fut, self))
            return fut

    def abandon(self, fut: Future) -> None:
        """No request waits for this compile any more: dropped if not started, stopped if running."""
        self.service.abandon(fut)

    def close(self) -> None:
        """Its queued compiles dropped, its running one stopped; the child ends unless another engine
        of this process compiles against the same vocabulary."""
        self.closed = True
        with self.cache.lock:
            pending = list(self.cache.entries.values())
        for fut in pending:
            fut.cancel()  # only those not started: a running one is the service's to stop
        self.service.leave(self)

    @property
    def child(self) -> Popen | None:
        """The child process this engine's compiles run in (None before the first, or between children)."""
        return None if self._vocab is None else self.service.child(self._vocab.key)

    @property
    def running(self) -> Future | None:
        """This engine's compile that runs now, if one does."""
        return self.service.running(self)

    # --- called by the service, in its thread ------------------------------------------------------
    def vocabulary(self) -> Vocabulary:
        with self._vocab_lock:
            if self._vocab is None:
                import xgrammar as xgr

                info = xgr.TokenizerInfo.from_huggingface(self._load_tokenizer(), vocab_size=self.vocab_size,
                                                          stop_token_ids=list(self.stop_token_ids))
                text = info.serialize_json().encode()
                self._vocab = Vocabulary(info, text, hashlib.sha256(text).hexdigest())
            return self._vocab

    def compiled(self) -> None:
        self.cache.trim()  # the finished compile's size is known now


def _entry_bytes(key: tuple[str, str], fut: Future) -> int:
    done = fut.done() and not fut.cancelled() and fut.exception() is None
    return len(key[1]) + (fut.result().memory_size_bytes if done else 0)
