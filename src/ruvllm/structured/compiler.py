"""The engine core's grammar compiler: each request's constraint compiled by xgrammar against the
model's vocabulary on a thread of its own (the engine loop never waits for a compile; a request
waits for its own), cached by constraint."""

from __future__ import annotations

import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable

from ruvllm.structured.spec import StructuredOutputs


class GrammarCompiler:
    def __init__(self, load_tokenizer: Callable[[], Any], vocab_size: int, stop_token_ids: tuple[int, ...],
                 cache_size: int = 256) -> None:
        self._load_tokenizer, self.vocab_size, self.stop_token_ids = load_tokenizer, vocab_size, stop_token_ids
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="ruvllm-grammar")
        self._compiler: Any = None  # made on the pool's thread at the first compile (the tokenizer's load)
        self._cache: OrderedDict[tuple[str, str], Future] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()

    def submit(self, spec: StructuredOutputs) -> Future:
        """A future of the compiled grammar; the same one for every request with the same constraint."""
        key = spec.key
        with self._lock:
            fut = self._cache.get(key)
            if fut is not None and not (fut.done() and fut.exception() is not None):
                self._cache.move_to_end(key)
                return fut
            fut = self._cache[key] = self._pool.submit(self._compile, spec)
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
            return fut

    def _compile(self, spec: StructuredOutputs) -> Any:
        import xgrammar as xgr

        if self._compiler is None:
            info = xgr.TokenizerInfo.from_huggingface(self._load_tokenizer(), vocab_size=self.vocab_size,
                                                      stop_token_ids=list(self.stop_token_ids))
            self._compiler = xgr.GrammarCompiler(info, max_threads=1)
        return self._compiler.compile_grammar(spec.to_grammar())
