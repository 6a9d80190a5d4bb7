"""Streaming front of the engine: asyncio callers submit requests and read their outputs; the core
runs elsewhere (a child process by default, or a thread of this one) behind a CoreClient.

The front tokenizes, checks and fans a request out into the core's sequences (input_processor),
and turns the core's per-step deltas into each caller's outputs (output_processor): detokenizing
and stop strings happen here, never in the core's loop. Adding and aborting never wait for the
core, so a caller that gives up at any point (a dropped connection cancels its task) leaves at
most an abort behind. If the core fails or its process dies, every open request and every later
call gets EngineDeadError, `is_alive` turns false, and the failure callbacks run (the server exits
non-zero so a supervisor restarts it).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Callable

from ruvllm.config import EngineConfig
from ruvllm.core.engine_core import EngineCore
from ruvllm.engine.core_client import CoreClient, ProcessCoreClient, ReplicaState, ThreadCoreClient
from ruvllm.engine.core_launcher import CoreLauncher
from ruvllm.engine.data_parallel import DataParallelConfig, DataParallelCoreClient
from ruvllm.engine.input_processor import core_requests, embed_request, stop_token_set
from ruvllm.engine.output_processor import OutputProcessor
from ruvllm.engine.prompts import PromptInput, encode_prompt
from ruvllm.errors import AdapterNotFoundError, EngineDeadError, EngineShutdownError, RequestError
from ruvllm.messages import (CoreOutput, EngineInfo, EngineStats, GetStats, LoadAdapter, ResetPrefixCache,
                             UnloadAdapter)
from ruvllm.outputs import EmbeddingOutput, OutputKind, RequestOutput
from ruvllm.request import Priority
from ruvllm.sampling_params import SamplingParams

log = logging.getLogger(__name__)


@dataclass
class Stream:
    """One caller's queue on its own event loop, fed from the client's thread (deliver)."""

    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[Any] = field(default_factory=asyncio.Queue)


class AsyncEngine:
    def __init__(self, client: CoreClient, tokenizer: Any) -> None:
        """This front over a CoreClient whose core is loaded (`launch` starts one in a child
        process; `in_process` runs one on a thread; the Ray deployment passes its handle's)."""
        self._client = client
        self.tokenizer = tokenizer
        self.info: EngineInfo = client.info
        self._eos = stop_token_set(self.info, tokenizer)
        self._processor = OutputProcessor(tokenizer)
        self._streams: dict[str, Stream] = {}
        # Embedding requests waiting for their vector: request id -> (its caller, its token ids)
        self._embeds: dict[str, tuple[Stream, list[int]]] = {}
        self._ids = itertools.count()
        # Guards the processor and the streams: callers add and abort on their event loops while
        # the client's thread hands outputs in.
        self._lock = threading.Lock()
        self._closed: EngineDeadError | EngineShutdownError | None = None
        self._failure_callbacks: list[Callable[[EngineDeadError], None]] = []
        client.start(self._on_outputs, self._fail, self._lose)

    @classmethod
    def launch(cls, config: EngineConfig | None = None, data_parallel: DataParallelConfig | None = None,
               launcher: CoreLauncher | None = None) -> AsyncEngine:
        """The core in a child process, loading `config`'s model there while the tokenizer loads here.
        `data_parallel` with size N > 1: N core processes, each with its own model copy and KV pool,
        behind this one front (engine/data_parallel.py). `launcher`: a one-core engine's process forked
        from it (a front that starts many: engine/core_launcher.py)."""
        config = config or EngineConfig()
        client: ProcessCoreClient | DataParallelCoreClient
        if data_parallel is not None and data_parallel.size > 1:
            client = DataParallelCoreClient(config, data_parallel)
        else:
            client = ProcessCoreClient(config, launcher=launcher)  # started first: the two loads overlap
        try:
            from ruvllm.loader import load_model_config, load_tokenizer, resolve_model

            src = resolve_model(config.model)
            # The files' checks (headers only, milliseconds) before the tokenizer: a broken model
            # fails at once with their one-line reason, not after transformers has tried it for seconds.
            load_model_config(src)
            tokenizer = load_tokenizer(src)
            client.wait_ready()
        except BaseException:
            client.shutdown()
            raise
        return cls(client, tokenizer)

    @classmethod
    def in_process(cls, core: EngineCore, tokenizer: Any) -> AsyncEngine:
        """The core on a thread of this process (tests, notebooks, models built in memory)."""
        return cls(ThreadCoreClient(core), tokenizer)

    async def read_outputs_here(self) -> None:
        """Call on the event loop that serves this engine for the rest of its life (a server's): a
        core process's outputs are then read on this loop instead of on a thread of their own
        (ProcessCoreClient.read_on), so a step's outputs reach the streams with no hand-over between
        threads. Other clients (a core on a thread, data-parallel replicas) go on as they are. After
        it, blocking calls (stats, load_lora...) must come from other threads."""
        if isinstance(self._client, ProcessCoreClient):
            await self._client.read_on()

    # --- caller side -----------------------------------------------------------------------------
    async def generate(self, prompt: PromptInput, params: SamplingParams | None = None,
                       request_id: str | None = None, priority: Priority = Priority.NORMAL,
                       output_kind: OutputKind = OutputKind.CUMULATIVE, lora: str | None = None,
                       cache_salt: str | None = None, stacked: tuple[str, ...] = ()) -> AsyncIterator[RequestOutput]:
        """Yields the request's outputs after every step that changes it (what `output_kind` says:
        everything so far, only what is new, or only the end); the last one is finished.

        Leaving the iteration early (break, cancellation, a disconnected client) aborts the request.
        `lora`: a loaded adapter's name (AdapterNotFoundError when none has it). `cache_salt`: prefix-
        cache blocks are shared only among requests with the same salt (a tenant's). `stacked`:
        loaded adapters whose deltas are added after `lora`'s, in order (a tenant's micro-LoRA)."""
        if self._closed is not None:
            raise self._closed
        params = params or SamplingParams()
        request_id = request_id or f"req-{next(self._ids)}"
        token_ids, text = encode_prompt(self.tokenizer, prompt)
        self._check_loaded(lora, stacked)
        seqs = core_requests(request_id, token_ids, params, priority, self.info, self._eos, lora, cache_salt, stacked)
        stream = Stream(asyncio.get_running_loop())
        with self._lock:
            if self._closed is not None:
                raise self._closed
            if request_id in self._streams:
                raise ValueError(f"request id {request_id!r} is already in use")
            self._processor.add(request_id, token_ids, text, params, [s.request_id for s in seqs], output_kind)
            self._streams[request_id] = stream
        finished = False
        try:
            self._client.add(seqs)
            while True:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            with self._lock:
                self._streams.pop(request_id, None)
                running = self._processor.abort(request_id)
            if running and not finished:
                self._client.abort(running)

    def write(self, prompts: list[list[int]], params: SamplingParams) -> list[list[str]]:
        """The learner's host's (learning/learner.py AdapterHost): the base model's texts for `prompts`
        (params.n each), with no adapter. Blocking, on a loop of its own: from a thread that runs
        none (the server's learning threads), never from an event loop's."""
        async def one(ids: list[int]) -> list[str]:
            last = None
            async for last in self.generate(ids, params, output_kind=OutputKind.FINAL_ONLY):
                pass
            return [c.text for c in last.outputs] if last is not None else []

        async def every() -> list[list[str]]:
            return list(await asyncio.gather(*(one(p) for p in prompts)))

        return asyncio.run(every())

    async def embed(self, prompt: PromptInput, request_id: str | None = None, priority: Priority = Priority.NORMAL,
                    lora: str | None = None, cache_salt: str | None = None,
                    pooling: str | None = None, stacked: tuple[str, ...] = ()) -> EmbeddingOutput:
        """The input's final hidden states pooled (`pooling`, else the engine's EngineInfo.pooling) and
        L2-normalized. Scheduled beside generation under the same token budget; its K/V is freed as
        soon as it is computed. Cancelling the call aborts the request."""
        if self._closed is not None:
            raise self._closed
        request_id = request_id or f"emb-{next(self._ids)}"
        token_ids, _ = encode_prompt(self.tokenizer, prompt)
        self._check_loaded(lora, stacked)
        core_request = embed_request(request_id, token_ids, priority, self.info, pooling, lora, cache_salt, stacked)
        stream = Stream(asyncio.get_running_loop())
        with self._lock:
            if self._closed is not None:
                raise self._closed
            if request_id in self._embeds or request_id in self._streams:
                raise ValueError(f"request id {request_id!r} is already in use")
            self._embeds[request_id] = (stream, token_ids)
        finished = False
        try:
            self._client.add([core_request])
            item = await stream.queue.get()
            finished = True
            if isinstance(item, BaseException):
                raise item
            return item
        finally:
            with self._lock:
                self._embeds.pop(request_id, None)
            if not finished:
                self._client.abort([request_id])

    def _check_loaded(self, lora: str | None, stacked: tuple[str, ...]) -> None:
        loaded = self.loras
        for name in ((lora, *stacked) if lora is not None else ()):
            if name not in loaded:
                raise AdapterNotFoundError(f"no adapter named {name!r} is loaded", param="model")

    async def abort(self, request_id: str) -> None:
        """Abort a request by id (another task's): its stream ends with a finished output whose
        running completions say "abort". Unknown or finished ids are ignored."""
        with self._lock:
            running, last = self._processor.abort_with_output(request_id)
            stream = self._streams.get(request_id)
        if running:
            self._client.abort(running)
        if stream is not None and last is not None:
            deliver(stream, last)

    def stats(self) -> EngineStats:
        """The core's load now: answered after every command sent before this call (waits for the
        current step to end)."""
        if self._closed is not None:
            return self._client.latest_stats
        return self._client.call(GetStats()).stats

    def reset_prefix_cache(self) -> EngineStats:
        return self._client.call(ResetPrefixCache()).stats

    # --- LoRA adapters (blocking calls: from a server, run them on a worker thread) ----------------
    def load_lora(self, name: str, path: str, files: dict[str, tuple[str, int, int]] | None = None) -> EngineStats:
        """Load a PEFT adapter folder under `name`: its file is read off the core's loop, then the
        adapter is installed between two steps. AdapterError names what is wrong with it. `files`:
        what the server's path policy checked of each file (lora/checked_files.py): only those are read."""
        return self._client.call(LoadAdapter(name, str(path), files)).stats

    def unload_lora(self, name: str) -> EngineStats:
        """New requests cannot use it from now; requests running with it finish first."""
        return self._client.call(UnloadAdapter(name)).stats

    @property
    def loras(self) -> list[str]:
        """The adapters loaded as of the core's latest step or command (never blocks)."""
        return list(self._client.latest_stats.adapters)

    @property
    def snapshot(self) -> EngineStats:
        """The stats the core published after its latest step; never blocks."""
        return self._client.latest_stats

    @property
    def is_alive(self) -> bool:
        return self._closed is None and self._client.is_alive

    @property
    def replicas(self) -> list[ReplicaState]:
        """Each engine core behind this front (one, or the data-parallel replicas); never blocks."""
        return self._client.replica_states()

    @property
    def failure(self) -> EngineDeadError | None:
        """Why the engine stopped, when it failed (None while it runs, or after a clean shutdown)."""
        return self._closed if isinstance(self._closed, EngineDeadError) else None

    def on_failure(self, callback: Callable[[EngineDeadError], None]) -> None:
        """Call `callback` (on the client's thread) if the core fails; at once if it already has."""
        self._failure_callbacks.append(callback)
        if self.failure is not None:
            callback(self.failure)

    def abort_all(self) -> None:
        """Abort every request in flight; their callers get EngineShutdownError."""
        with self._lock:
            streams = list(self._streams.items())
            running = [sid for rid, _ in streams for sid in self._processor.abort(rid)]
            self._streams.clear()
            streams += [(rid, stream) for rid, (stream, _) in self._embeds.items()]
            running += list(self._embeds)
            self._embeds.clear()
        if running:
            self._client.abort(running)
        for rid, stream in streams:
            deliver(stream, EngineShutdownError(f"request {rid} aborted: the engine is shutting down"))

    def shutdown(self) -> None:
        with self._lock:
            if self._closed is None:
                self._closed = EngineShutdownError("the engine is shut down")
        self.abort_all()
        self._client.shutdown()

    # --- the client's thread ---------------------------------------------------------------------
    def _on_outputs(self, outputs: list[CoreOutput]) -> None:
        with self._lock:
            embedded = [(self._embeds.pop(o.request_id), o) for o in outputs if o.request_id in self._embeds]
            if embedded:
                outputs = [o for o in outputs if o.request_id not in {e.request_id for _, e in embedded}]
            results, aborts = self._processor.process(outputs)
            targets: list[tuple[Stream | None, Any]] = [(self._streams.get(r.request_id), r) for r in results]
        for (stream, ids), out in embedded:
            targets.append((stream, _embedding(out, ids)))
        if aborts:
            self._client.abort(aborts)  # stop strings matched: the core frees those sequences
        deliver_all([(stream, result) for stream, result in targets if stream is not None])

    def _lose(self, seq_ids: list[str], error: BaseException) -> None:
        """A data-parallel replica failed: the requests it served end with `error`; the rest go on."""
        with self._lock:
            request_ids = self._processor.request_ids_of(seq_ids)
            streams = [self._streams.pop(rid, None) for rid in request_ids]
            streams += [self._embeds.pop(sid)[0] for sid in seq_ids if sid in self._embeds]
            for rid in request_ids:
                self._processor.abort(rid)
        for stream in streams:
            if stream is not None:
                deliver(stream, error)

    def _fail(self, error: EngineDeadError) -> None:
        log.error("%s; every open request is failed and the engine stops", error)
        with self._lock:
            self._closed = error
            streams = list(self._streams.items())
            for rid, _ in streams:
                self._processor.abort(rid)
            self._streams.clear()
            streams += [(rid, stream) for rid, (stream, _) in self._embeds.items()]
            self._embeds.clear()
        for _, stream in streams:
            deliver(stream, error)
        for callback in self._failure_callbacks:
            try:
                callback(error)
            except Exception:
                log.exception("engine failure callback failed")


def _embedding(out: CoreOutput, token_ids: list[int]) -> EmbeddingOutput | RequestError:
    """An embedding request's one output: its vector, or why it ended without one (the core ends a
    request that names an adapter unloaded since the front checked it)."""
    if out.embedding is None:
        return RequestError(out.error or f"request {out.request_id} ended before it was embedded "
                                          f"({out.finish_reason or 'no reason given'})", "input")
    return EmbeddingOutput.from_bytes(out.request_id, token_ids, out.embedding, out.num_cached_tokens, out.queue_time)


def deliver_all(items: list[tuple[Stream, Any]]) -> None:
    """A step's items handed over with one wake-up per event loop (not one per stream: at 32 streams
    that is 32 writes to the loop's wake-up pipe and as many of its turns, per step), and none for
    the loop this runs on (outputs read on the loop: ProcessCoreClient.read_on); each queue gets its
    items in order."""
    here = asyncio._get_running_loop()  # asyncio's form of get_running_loop that gives None off a loop
    if len(items) == 1 and items[0][0].loop is not here:
        deliver(*items[0])
        return
    by_loop: dict[asyncio.AbstractEventLoop, list[tuple[Stream, Any]]] = {}
    for stream, item in items:
        by_loop.setdefault(stream.loop, []).append((stream, item))
    for loop, batch in by_loop.items():
        if loop is here:
            _put_all(batch)
            continue
        try:
            loop.call_soon_threadsafe(_put_all, batch)
        except RuntimeError:
            pass  # a loop that has closed has nobody left to tell


def _put_all(batch: list[tuple[Stream, Any]]) -> None:
    for stream, item in batch:
        stream.queue.put_nowait(item)


def deliver(stream: Stream, item: Any) -> None:
    """Hand an item to a caller's event loop; a loop that has closed has nobody left to tell."""
    try:
        stream.loop.call_soon_threadsafe(stream.queue.put_nowait, item)
    except RuntimeError:
        pass
