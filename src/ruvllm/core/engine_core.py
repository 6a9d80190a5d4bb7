"""The engine core: scheduler and KV cache manager over an executor, one step at a time.

It takes self-contained CoreRequests (token ids and sampling parameters; tokenizing and checking are
the front's), and each step returns only what is new for each sequence it touched. It finishes a
sequence for EOS, a stop token or length; stop strings are text, so the front decides those and
sends an abort. The core knows nothing of files, models or devices: the executor (a Worker) does.
"""

from __future__ import annotations

import atexit
import dataclasses
import logging
import threading
import weakref
from collections.abc import Callable, Iterable
from concurrent.futures import FIRST_COMPLETED, wait
from typing import TYPE_CHECKING, Any, Protocol

import msgspec

from ruvllm.config import EngineConfig
from ruvllm.core.kv_cache_manager import KVCacheManager
from ruvllm.core.scheduler import Scheduler
from ruvllm.core.adapters import AdapterRegistry
from ruvllm.errors import RequestError
from ruvllm.messages import CoreOutput, CoreRequest, EngineInfo, EngineStats
from ruvllm.outputs import ModelRunnerOutput, SchedulerOutput
from ruvllm.request import ArrivalCounter, FinishReason, Priority, Request

if TYPE_CHECKING:
    from ruvllm.lora.checked_files import CheckedFiles
    from ruvllm.lora.manager import Served  # the worker's; the core only passes it on
    from ruvllm.structured.compiler import GrammarCompiler

log = logging.getLogger(__name__)


class Executor(Protocol):
    """Runs one step's SchedulerOutput on the model (the Worker, or a group of them)."""

    def info(self) -> EngineInfo: ...

    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput: ...

    def read_adapter(self, name: str, path: str, checked: CheckedFiles | None = None) -> Served: ...

    def install_adapter(self, adapter: Served) -> None: ...

    def remove_adapter(self, name: str) -> None: ...

    def load_tokenizer(self) -> Any: ...


def _close_at_exit(grammars: weakref.ref[GrammarCompiler]) -> None:
    compiler = grammars()
    if compiler is not None:
        compiler.close()


class SharedGrammars:
    """The grammar compiler of one loaded model, made at the first structured request of any core over
    it: a core and the cores `LLM.with_settings` makes over the same worker share it (a compile
    depends only on the vocabulary and the constraint), so they share one zygote and one cache of
    compiled constraints. Each zygote's start imports xgrammar, ~5.4 s of CPU here: the suite's
    servers, each a with_settings copy of a session's engine, started one apiece (session 27).
    Closed when the last core using it closes or is dropped."""

    def __init__(self, executor: Executor, info: EngineInfo, timeout: float, idle_exit: float) -> None:
        self._load_tokenizer: Callable[[], Any] | None = executor.load_tokenizer
        self._vocab, self._stop = info.vocab_size, info.eos_token_ids
        self._timeout, self._idle_exit = timeout, idle_exit
        # Reentrant: a collection inside get() (on the thread holding it) can drop another core that
        # shares it, whose finalizer releases here.
        self._lock = threading.RLock()
        self._users = 0
        self.compiler: GrammarCompiler | None = None

    def acquire(self) -> None:
        with self._lock:
            self._users += 1

    def get(self) -> GrammarCompiler:
        with self._lock:
            if self.compiler is None:
                from ruvllm.structured.compiler import GrammarCompiler

                if self._load_tokenizer is None:
                    raise RuntimeError("the grammar compiler is closed (every core using it was)")
                self.compiler = GrammarCompiler(self._load_tokenizer, self._vocab, self._stop, self._timeout,
                                                idle_exit=self._idle_exit)
                atexit.register(_close_at_exit, weakref.ref(self.compiler))
            return self.compiler

    def release(self, dropped: bool) -> None:
        """A core is done with it. The last one closes the compiler (and lets the worker's loader go):
        a dropped core's on a thread of its own, as a collection can run inside one of the
        compiler's threads while it holds the compiler's lock, which close() takes; at the
        interpreter's exit atexit closes it on the main thread instead (a thread started then would
        be cut off as the interpreter finalizes, mid-close)."""
        with self._lock:
            self._users -= 1
            if self._users:
                return
            compiler, self.compiler, self._load_tokenizer = self.compiler, None, None
        if compiler is None:
            return
        if dropped:
            threading.Thread(target=compiler.close, name="ruvllm-grammar-close", daemon=True).start()
        else:
            compiler.close()


class EngineCore:
    def __init__(self, executor: Executor, config: EngineConfig, grammars: SharedGrammars | None = None) -> None:
        """grammars: another core's, over the same worker (LLM.with_settings); else this core's own."""
        self.executor = executor
        self.info = executor.info()
        cache = config.cache
        # The disk tier is the executor's store (worker/kv_disk.py), when it has one.
        self.kv = KVCacheManager(self.info.num_hot_blocks, cache.block_size, cache.enable_prefix_caching,
                                 self.info.num_cold_blocks, cache.kv_hot_tokens, self.info.kv_windows,
                                 disk=getattr(executor, "kv_disk", None))
        # The worker resolved the device's defaults (the token budget); the scheduler uses the same.
        sched = dataclasses.replace(config.scheduler, max_num_batched_tokens=self.info.max_num_batched_tokens)
        self.scheduler = Scheduler(sched, self.kv, self.info.max_loras, config.speculation.num_lookahead)
        self._spec = SpecStats()
        self._arrivals = ArrivalCounter()
        self._core_requests: dict[str, CoreRequest] = {}  # until the worker has seen them
        self.adapter_registry = AdapterRegistry(self.info.max_loras, config.lora.cpu_capacity)
        self._compile_timeout = config.grammar_compile_timeout
        self.grammars = grammars or SharedGrammars(executor, self.info, config.grammar_compile_timeout,
                                                   config.grammar_idle_exit)
        self.grammars.acquire()
        # A core dropped without close() (a test's server, an AsyncEngine over a copy of an LLM's core)
        # lets the compiler go: the compiler's threads hold the compiler, not the core.
        self._release_grammars = weakref.finalize(self, self.grammars.release, True)
        self._release_grammars.atexit = False
        self._compiling: dict[str, Request] = {}  # requests whose grammar is still compiling
        # stats() built once per change: anything they read that changes sets _stats_dirty after it
        # changed (a step, an add, an abort, an adapter installed or removed, the cache reset); the
        # lock orders the build against a change from another thread (an adapter installed beside
        # the loop): a change during a build leaves the flag set, so the next call builds again.
        self._stats: EngineStats | None = None
        self._stats_dirty = True
        self._stats_lock = threading.Lock()

    # --- adapters --------------------------------------------------------------------------------
    def add_adapter(self, name: str, path: str, checked: CheckedFiles | None = None) -> None:
        """Read, check and install a LoRA adapter under `name` (AdapterError names what is wrong;
        `checked`: the files the server's path policy checked, the only ones read then)."""
        self.install_adapter(self.read_adapter(name, path, checked), path)

    def read_adapter(self, name: str, path: str, checked: CheckedFiles | None = None) -> Served:
        """The file work of a load: safe on another thread while the core steps."""
        self.adapter_registry.check_new(name)
        return self.executor.read_adapter(name, path, checked)

    def install_adapter(self, adapter: Served, path: str) -> None:
        """Make a read adapter servable (any thread, even while a step runs: it takes a slot when a
        step first uses it)."""
        self.adapter_registry.add(adapter.name, path, adapter.num_slots, adapter.scaling_pass,
                                  lambda: self.executor.install_adapter(adapter))
        self._stats_dirty = True

    def remove_adapter(self, name: str) -> None:
        """Unload an adapter: new requests cannot use it at once; requests running with it finish
        first, then its slot is freed."""
        if self.adapter_registry.unload(name):
            self._drop_adapter(name)
        self._stats_dirty = True

    def adapters(self) -> list[str]:
        return self.adapter_registry.names()

    def _drop_adapter(self, name: str) -> None:
        self.adapter_registry.drop(name)
        self.executor.remove_adapter(name)

    def _release(self, req: Request) -> None:
        """A request left the core: its holds on its adapters (stacked ones too) end."""
        for run in req.adapter_runs:
            if self.adapter_registry.release(run):
                self._drop_adapter(run.name)

    # --- requests --------------------------------------------------------------------------------
    def add_request(self, cr: CoreRequest) -> None:
        """Queue one sequence. The front has checked it against EngineInfo; only a duplicate id,
        which the front cannot see (another front's request), is refused here."""
        try:
            self._add_request(cr)
        finally:  # (a refused one may have taken and given back adapter holds: counted as a change)
            self._stats_dirty = True

    def _add_request(self, cr: CoreRequest) -> None:
        if cr.request_id in self.scheduler.requests:
            raise RequestError(f"request id {cr.request_id!r} is already in use")
        # admitted once _failed_compiles has seen its grammar compiled (a failed compile ends it)
        grammar = self._grammar_compiler().submit(cr.params.structured) if cr.params.structured else None
        runs = self.adapter_registry.acquire_stack((cr.adapter, *cr.stacked)) if cr.adapter is not None else ()
        adapter, stacked = (runs[0], runs[1:]) if runs else (None, ())
        sibling = self.scheduler.requests.get(cr.prompt_sibling) if cr.prompt_sibling else None
        req = Request(request_id=cr.request_id, prompt_token_ids=list(cr.prompt_token_ids), params=cr.params,
                      eos_token_ids=tuple(cr.eos_token_ids), priority=Priority(cr.priority),
                      arrival=self._arrivals.next(), prompt_sibling=sibling, max_total_tokens=self.info.max_seq_len,
                      adapter=adapter, stacked=stacked, salt=cr.cache_salt, grammar=grammar, pooling=cr.pooling)
        if cr.arrival_time:
            req.arrival_time = cr.arrival_time
        if grammar is not None:
            self._compiling[cr.request_id] = req
        self._core_requests[cr.request_id] = cr
        self.scheduler.add(req)

    def abort(self, request_ids: Iterable[str]) -> None:
        """End these sequences wherever they are and free their blocks; unknown ids are ignored
        (a sequence may have finished while its abort was on the way)."""
        for rid in request_ids:
            req = self.scheduler.requests.get(rid)
            self._core_requests.pop(rid, None)
            compiling = self._compiling.pop(rid, None)
            if compiling is not None and all(r.grammar is not compiling.grammar for r in self._compiling.values()):
                self._grammar_compiler().abandon(compiling.grammar)  # nobody else waits for it: stopped
            if req is not None:
                self.scheduler.finish(req, FinishReason.ABORT)
                self._release(req)
                self._stats_dirty = True

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.has_work

    # --- the step --------------------------------------------------------------------------------
    def step(self) -> list[CoreOutput]:
        try:
            return self._step()
        finally:
            self._stats_dirty = True

    def _step(self) -> list[CoreOutput]:
        failed = self._failed_compiles()
        so = self.scheduler.schedule()
        for seq in so.seqs:
            cr = self._core_requests.pop(seq.request_id, None)
            if cr is not None:
                so.new_requests.append(cr)
                req = self.scheduler.requests[seq.request_id]
                if req.grammar is not None:
                    so.grammars[seq.request_id] = req.grammar.result()
        if not so.has_work:
            if self._compiling:  # nothing else to do: wait for a compile rather than spin
                wait([r.grammar for r in self._compiling.values()], timeout=0.05, return_when=FIRST_COMPLETED)
            elif self.scheduler.disk_reads:  # or for the disk tier's reads
                wait(self.scheduler.disk_reads, timeout=0.05, return_when=FIRST_COMPLETED)
            return failed
        ro = self.executor.execute(so)
        if so.is_empty:
            return failed
        self._spec.count(ro)
        outputs = []
        for req in self.scheduler.update(so, ro):
            outputs.append(self._output(req, ro))
            if req.is_finished:
                self._release(req)
        return failed + outputs

    # --- structured outputs ----------------------------------------------------------------------
    def _grammar_compiler(self) -> GrammarCompiler:
        return self.grammars.get()

    def _failed_compiles(self) -> list[CoreOutput]:
        """Requests whose grammar compiled: ready to be admitted; those whose compile failed or passed
        grammar_compile_timeout: ended with the reason (CoreOutput.error, a 400 at the front); a
        model without a tokenizer: ended as aborted. Checked before each schedule, so the scheduler
        only ever admits a compiled one."""
        from ruvllm.structured.compiler import CompileError

        failed = []
        for rid, req in list(self._compiling.items()):
            if not req.grammar.done():
                continue
            del self._compiling[rid]
            exc = req.grammar.exception() if not req.grammar.cancelled() else CompileError("the compile was dropped")
            if exc is None:
                req.grammar_ready = True
            elif not req.is_finished:
                log.warning("request %s: its grammar did not compile: %s", rid, exc)
                self._core_requests.pop(rid, None)
                self.scheduler.finish(req, FinishReason.ABORT)
                self._release(req)
                failed.append(CoreOutput(rid, finish_reason=FinishReason.ABORT.value,
                                         error=str(exc) if isinstance(exc, CompileError) else None))
        return failed

    @staticmethod
    def _output(req: Request, ro: ModelRunnerOutput) -> CoreOutput:
        rid = req.request_id
        out = CoreOutput(rid, num_cached_tokens=req.num_cached_tokens)
        if rid in ro.sampled:
            n = req.num_new_tokens  # fewer than sampled when a stop ended it among proposals
            out.new_token_ids = ro.sampled[rid][:n]
            if rid in ro.logprobs:
                out.new_logprobs = ro.logprobs[rid][:n]
        if rid in ro.prompt_logprobs:
            out.new_prompt_logprobs = ro.prompt_logprobs[rid]
        if rid in ro.pooled:
            out.embedding = ro.pooled[rid]
        if req.is_finished:
            out.finish_reason = req.finish_reason.value
            out.stop_reason = req.stop_reason if isinstance(req.stop_reason, int) else None
        if not req.queue_time_sent and req.first_scheduled_time is not None:
            req.queue_time_sent = True
            out.queue_time = req.first_scheduled_time - req.arrival_time
        return out

    # --- introspection ---------------------------------------------------------------------------
    def stats(self) -> EngineStats:
        """The core's load now: built again only after a change (the flag is cleared before the
        build, so a change made while it runs is not lost). The disk tier's bytes are read each time:
        its writer thread changes them between steps."""
        with self._stats_lock:
            if self._stats_dirty or self._stats is None:
                self._stats_dirty = False
                self._stats = self._build_stats()
            elif self.kv.disk is not None and self._stats.disk_bytes != (b := self.kv.disk.index.bytes_used):
                self._stats = msgspec.structs.replace(self._stats, disk_bytes=b)
            return self._stats

    def _build_stats(self) -> EngineStats:
        return EngineStats(running=len(self.scheduler.running), waiting=len(self.scheduler.waiting),
                           free_blocks=self.kv.num_free_blocks, total_blocks=self.info.num_blocks,
                           free_cold_blocks=self.kv.pool.num_free_cold, cold_blocks=self.kv.pool.num_cold,
                           prefix_queries=self.kv.stats.queries, prefix_hits=self.kv.stats.hits,
                           preemptions=self.scheduler.num_preemptions, adapters=self.adapters(),
                           spec_proposed=self._spec.proposed, spec_accepted=self._spec.accepted,
                           spec_verifications=self._spec.verifications, **self._tier_stats())

    def _tier_stats(self) -> dict[str, int]:
        """Bytes each KV tier holds now, and the disk tier's lookups."""
        pool, info, disk = self.kv.pool, self.info, self.kv.disk
        return {"hot_bytes": (pool.num_hot - pool.num_free_hot) * info.hot_block_bytes,
                "cold_bytes": (pool.num_cold - pool.num_free_cold) * info.cold_block_bytes,
                "disk_bytes": disk.index.bytes_used if disk is not None else 0,
                "disk_queries": self.kv.stats.disk_queries, "disk_hits": self.kv.stats.disk_hits}

    def _spill_cached(self, per_call: int = 64) -> None:
        if self.kv.disk is None:  # (blocks held by requests still running are cached only once computed)
            return
        spills = self.kv.spill_cached()
        for i in range(0, len(spills), per_call):  # a step with no sequence: the worker only writes
            self.executor.execute(SchedulerOutput(kv_spills=spills[i:i + per_call]))

    def reset_prefix_cache(self) -> None:
        self.kv.pool.reset_prefix_cache()
        self._stats_dirty = True

    def close(self) -> None:
        """Release what the executor holds outside this process (a worker's tensor-parallel ranks).
        With a disk tier, the cached blocks not on disk yet are written first: the prefix cache
        outlives the process."""
        self._spill_cached()
        if self._release_grammars.detach() is not None:  # (once: close() may be called again)
            self.grammars.release(dropped=False)
        close = getattr(self.executor, "close", None)  # an optional part of the Executor protocol
        if close is not None:
            close()


@dataclasses.dataclass
class SpecStats:
    """Speculative decoding's counters: tokens proposed, of those accepted, and verifications
    (sequence-steps that scored at least one proposal)."""

    proposed: int = 0
    accepted: int = 0
    verifications: int = 0

    def count(self, ro: ModelRunnerOutput) -> None:
        for rid, n in ro.num_proposed.items():  # only sequences that had a proposal scored
            self.proposed += n
            self.accepted += len(ro.sampled[rid]) - 1
            self.verifications += 1
