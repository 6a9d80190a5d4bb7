"""Many models behind one server (docs/server.md, "Many models"): each model an engine core in a process
of its own (`AsyncEngine.launch`), loaded on its first request or at start (`--preload`), unloaded
after `keep_alive` seconds idle, or when a load needs its memory (the least recently used idle model
first). The pool is the one record of which models exist, their state (unloaded, loading, loaded),
their memory and who holds them; ServerState reads "the engine for this model" from it.

A request holds its model from routing to the last byte of its response (`acquire` ... `release`;
ModelHolds releases after the response, streams included), so an idle model is one nobody holds. The
pool runs on the server's event loop; loading and unloading run on worker threads (the child process
loads the weights), so a load never stalls another model's requests."""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector
from starlette.types import ASGIApp, Receive, Scope, Send

from ruvllm.engine import core_launcher
from ruvllm.engine.core_launcher import CoreLauncher
from ruvllm.errors import EngineDeadError
from ruvllm.server.errors import APIError

if TYPE_CHECKING:
    from ruvllm.config import EngineConfig
    from ruvllm.engine.async_engine import AsyncEngine
    from ruvllm.server.generation import ServerState

log = logging.getLogger(__name__)

UNLOADED, LOADING, LOADED = "unloaded", "loading", "loaded"
FOREVER = float("inf")


@dataclass
class ModelEntry:
    """One model the server knows: its engine while loaded, and what the pool decides it by."""

    name: str
    config: EngineConfig
    status: str = UNLOADED
    engine: AsyncEngine | None = None
    state: ServerState | None = None
    estimate_bytes: int | None = None  # weights + KV before loading (from the files' headers)
    loaded_bytes: int = 0  # weights + KV as loaded (EngineInfo)
    holds: int = 0  # requests routed to it whose responses have not ended
    last_used: float = 0.0
    keep_alive_s: float | None = None  # the latest request's; None: the server's default
    last_error: str | None = None
    loaded_at: float | None = None
    load_seconds: float | None = None
    pinned: bool = False  # the single model of a one-model server: never unloaded
    # Kept across unloads: a reload skips it (Gemma 3's, built from its GGUF's 262k-token vocabulary, takes
    # as long as loading the weights; it is tens of MB, outside --max-memory's account)
    tokenizer: Any = None
    _loading: asyncio.Future[None] | None = None
    _unloading: asyncio.Future[None] | None = None
    _timer: asyncio.TimerHandle | None = None

    @property
    def bytes(self) -> int:
        """What it takes now (loaded, or still shutting down) or will take (loading): the pool's memory
        account."""
        if self.status == LOADED or self._unloading is not None:
            return self.loaded_bytes
        if self.status == LOADING:
            return self.estimate_bytes or 0
        return 0


@dataclass(frozen=True)
class PoolSettings:
    keep_alive_s: float = 300.0  # an idle model's time before it unloads; FOREVER: never
    max_memory_bytes: int | None = None  # weights + KV of the loaded models together; None: no bound


_GO_UNITS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}
_GO_PART = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ns|us|µs|ms|s|m|h)")


def keep_alive_seconds(value: Any) -> float | None:
    """Ollama's `keep_alive`: seconds as a number, or a Go duration ("5m", "1h30m", "-1s"); negative: for
    ever. None (absent) stays None. A bad value is a 400 naming the field."""
    if value is None:
        return None
    if isinstance(value, bool):
        raise APIError(400, f"keep_alive: {value!r} is not a duration", "keep_alive")
    if isinstance(value, (int, float)):
        seconds = float(value)
    elif isinstance(value, str):
        text = value.strip()
        sign = -1.0 if text.startswith("-") else 1.0
        body = text.lstrip("+-")
        try:
            seconds = sign * float(body)  # a bare number is seconds, as Ollama reads it
        except ValueError:
            parts = _GO_PART.findall(body)
            if not body or "".join(n + u for n, u in parts) != body:
                raise APIError(400, f"keep_alive: {value!r} is not a duration (a number of seconds, or such as "
                                    "\"5m\", \"1h\", \"-1\")", "keep_alive") from None
            seconds = sign * sum(float(n) * _GO_UNITS[u] for n, u in parts)
    else:
        raise APIError(400, f"keep_alive: {value!r} is not a duration", "keep_alive")
    return FOREVER if seconds < 0 else seconds


def estimate_bytes(config: EngineConfig) -> int:
    """Weights + KV pool of `config` before loading: the weight plan the loader follows (from the files'
    headers) and the KV pool as kv_sizing.py sizes it (`ruvllm info -q` prints the same figures). On CUDA
    with no KV size given the pool is profiled at load; the estimate then counts the CPU default."""
    from ruvllm.device import resolve_device
    from ruvllm.loader import load_model_config, resolve_model
    from ruvllm.models.weight_plan import weight_plan
    from ruvllm.worker.kv_sizing import cold_kv_bytes_per_block, kv_bytes_per_block, kv_tier_blocks
    from ruvllm.attention.kv_quant import KV_BITS

    src = resolve_model(config.model)
    cfg = load_model_config(src)
    device = resolve_device(config.device)
    plan = weight_plan(src, config.quantization, config.dtype, device)
    max_len = min(config.max_model_len or cfg.max_position_embeddings, cfg.max_position_embeddings)
    cache, sched = config.cache, config.scheduler.resolved(device.type)
    hot, cold = kv_tier_blocks(cfg, cache, sched, plan.dtype, max_len)
    kv = hot * kv_bytes_per_block(cfg, cache.block_size, plan.dtype)
    if cold:
        kv += cold * cold_kv_bytes_per_block(cfg, cache.block_size, KV_BITS[cache.kv_cache_dtype])
    return plan.total_bytes + kv


def _mib(n: int) -> str:
    return f"{n / 2**20:,.0f} MiB"


class ModelPool:
    """The models one server serves (see the module's doc). `make_state(name, engine)` builds a loaded
    model's ServerState; `launch(config, tokenizer)` starts its engine (blocking: run on a worker thread),
    with the tokenizer of an earlier load of the model when there was one (None: load it too)."""

    def __init__(self, configs: dict[str, EngineConfig], settings: PoolSettings,
                 make_state: Callable[[str, AsyncEngine], ServerState],
                 launch: Callable[[EngineConfig, Any], AsyncEngine] | None = None,
                 estimate: Callable[[EngineConfig], int] = estimate_bytes) -> None:
        if not configs:
            raise ValueError("a model pool needs at least one model")
        self.entries = {name: ModelEntry(name, cfg) for name, cfg in configs.items()}
        self.default = next(iter(self.entries))  # a request that names no model gets the first one
        self.settings = settings
        self.created = int(time.time())  # /v1/models' `created` of a model not loaded
        self._make_state = make_state
        self._launch = launch or self._launch_core
        # Started at the first load; every load forks its core from it (engine/core_launcher.py: a
        # model's core ready in ~1.1 s rather than ~3 on the 2-core AVX2 EPYC).
        self._launcher: CoreLauncher | None = None
        self._estimate = estimate
        self._load_lock: asyncio.Lock | None = None  # made on the serving loop: loads go one at a time
        self._changed: asyncio.Condition | None = None  # a release, an unload or a load's end: room may have freed
        self._closed = False

    @classmethod
    def of_one(cls, name: str, engine: AsyncEngine, state: ServerState) -> ModelPool:
        """A one-model server's pool: its engine loaded by the caller, pinned (never unloaded here; the
        server stops when it fails, as it always has)."""
        pool = cls({name: None}, PoolSettings(keep_alive_s=FOREVER), lambda n, e: state)  # type: ignore[dict-item]
        e = pool.entries[name]
        e.status, e.engine, e.state, e.pinned = LOADED, engine, state, True
        e.loaded_bytes = engine.info.weight_bytes + engine.info.kv_cache_bytes
        e.loaded_at = time.time()
        return pool

    # --- what the routes read ---------------------------------------------------------------------
    @property
    def single(self) -> ServerState | None:
        """A one-model server's state: routing reads nothing of the request (today's path)."""
        if len(self.entries) == 1:
            e = self.entries[self.default]
            if e.pinned:
                return e.state
        return None

    def loaded(self) -> list[ModelEntry]:
        return [e for e in self.entries.values() if e.status == LOADED and e.engine is not None]

    @property
    def used_bytes(self) -> int:
        return sum(e.bytes for e in self.entries.values())

    @property
    def in_flight(self) -> int:
        """Sequences admitted over every loaded model (the drain waits for 0)."""
        return sum(e.state.admission.in_flight for e in self.loaded() if e.state is not None)

    def resolve(self, model: str | None) -> str:
        """The model a request's `model` names: a model's name, or a LoRA adapter's (its parent's engine:
        an adapter lives in the model it was loaded into). 404 otherwise, naming what is served."""
        if model is None or model == "":
            return self.default
        if model in self.entries:
            return model
        for e in self.loaded():
            if model in e.engine.loras:  # type: ignore[union-attr]
                return e.name
        served = ", ".join(f"`{m}`" for m in self.entries)
        raise APIError(404, f"The model `{model}` does not exist. This server serves {served}.", "model",
                       "model_not_found")

    def keep_alive_of(self, e: ModelEntry) -> float:
        return self.settings.keep_alive_s if e.keep_alive_s is None else e.keep_alive_s

    def expires_at(self, e: ModelEntry) -> float | None:
        """Wall-clock time it unloads if nobody uses it meanwhile (None: never, or not while it is held)."""
        keep = self.keep_alive_of(e)
        if e.status != LOADED or e.holds or e.pinned or keep == FOREVER:
            return None
        return time.time() + max(0.0, e.last_used + keep - time.monotonic())

    # --- holds ------------------------------------------------------------------------------------
    async def acquire(self, name: str, keep_alive_s: float | None = None) -> ServerState:
        """The model's state once loaded (loading it first when it is not), held until `release`."""
        e = self.entries[name]
        e.holds += 1
        self._cancel_timer(e)
        e.keep_alive_s = keep_alive_s  # as Ollama: each request's own, or the server's default when it names none
        try:
            await self._ensure_loaded(e)
        except BaseException:
            self.release(name)
            raise
        e.last_used = time.monotonic()
        return e.state  # type: ignore[return-value]

    def release(self, name: str) -> None:
        e = self.entries[name]
        e.holds -= 1
        e.last_used = time.monotonic()
        if e.holds == 0:
            self._idle(e)
            self._notify()

    # --- loading and unloading --------------------------------------------------------------------
    async def load(self, name: str) -> ModelEntry:
        """Load (the admin route, --preload); a loaded model only has its idle clock restarted."""
        e = self.entries[name]
        e.holds += 1
        e.keep_alive_s = None  # the server's default again (an earlier unload set 0)
        try:
            await self._ensure_loaded(e)
        finally:
            self.release(name)
        return e

    async def unload(self, name: str) -> ModelEntry:
        """Unload now when idle; a held model unloads as soon as its last request ends (keep_alive 0)."""
        e = self.entries[name]
        if e.pinned:
            raise APIError(400, f"`{name}` is this server's only model; it cannot be unloaded", "model",
                           "model_pinned")
        e.keep_alive_s = 0.0
        if e._loading is not None:  # the load in progress finishes first (a half-started child is not unloadable)
            await asyncio.shield(e._loading)
        if e.holds == 0 and e.status == LOADED:
            await self._unload(e)
        return e

    async def _ensure_loaded(self, e: ModelEntry) -> None:
        while e.status != LOADED:
            if self._closed:
                raise APIError(503, "the server is shutting down", None, "shutting_down")
            if e._unloading is not None:
                await asyncio.shield(e._unloading)
                continue
            if e._loading is None:
                e._loading = asyncio.ensure_future(self._load(e))
                e._loading.add_done_callback(lambda f, e=e: self._load_done(e, f))
            # shielded: a caller that goes away leaves the load running for the others (and for itself later)
            await asyncio.shield(e._loading)

    def _load_done(self, e: ModelEntry, f: asyncio.Future[None]) -> None:
        e._loading = None
        if not f.cancelled():
            f.exception()  # every waiter has it; marked retrieved so asyncio does not log it again
        self._notify()

    async def _load(self, e: ModelEntry) -> None:
        if self._load_lock is None:
            self._load_lock = asyncio.Lock()
        async with self._load_lock:  # one load at a time, in arrival order (asyncio's lock is FIFO)
            try:
                budget = self.settings.max_memory_bytes
                if budget is not None and e.estimate_bytes is None:  # headers only, but seconds for a big vocabulary
                    e.estimate_bytes = await asyncio.to_thread(self._estimate, e.config)
                if budget is not None and e.estimate_bytes > budget:
                    raise APIError(400, f"The model `{e.name}` needs about {_mib(e.estimate_bytes)} (weights + KV "
                                        f"cache), more than this server's whole --max-memory budget of "
                                        f"{_mib(budget)}; it can never be loaded here.", "model",
                                   "model_too_large")
                await self._make_room(e, e.estimate_bytes or 0)
                e.status = LOADING
                start = time.monotonic()
                engine = await asyncio.to_thread(self._launch, e.config, e.tokenizer)
            except APIError:
                e.status = UNLOADED
                raise
            except Exception as exc:
                e.status = UNLOADED
                e.last_error = f"{type(exc).__name__}: {exc}"
                log.error("model %s failed to load: %s", e.name, e.last_error)
                raise APIError(500, f"The model `{e.name}` could not be loaded: {exc}", "model",
                               "model_load_failed") from None
            if self._closed:  # the server stopped while it loaded
                await asyncio.to_thread(engine.shutdown)
                e.status = UNLOADED
                raise APIError(503, "the server is shutting down", None, "shutting_down")
            try:
                e.state = self._make_state(e.name, engine)
                await engine.read_outputs_here()  # the pool's engines live on this loop until unloaded
            except BaseException:
                await asyncio.to_thread(engine.shutdown)
                e.status = UNLOADED
                raise
            e.engine, e.status, e.last_error = engine, LOADED, None
            e.tokenizer = engine.tokenizer
            e.loaded_bytes = engine.info.weight_bytes + engine.info.kv_cache_bytes
            e.load_seconds, e.loaded_at, e.last_used = time.monotonic() - start, time.time(), time.monotonic()
            loop = asyncio.get_running_loop()
            engine.on_failure(lambda err, e=e, engine=engine: loop.call_soon_threadsafe(self._died, e, engine, err))
            log.info("model %s loaded in %.1f s (%s)", e.name, e.load_seconds, _mib(e.loaded_bytes))
        if e.holds == 0:  # loaded for nobody (preload, the admin route): its idle clock starts now
            self._idle(e)

    async def _make_room(self, e: ModelEntry, need: int) -> None:
        """Unload idle models, least recently used first, until `need` more bytes fit the budget; while the
        others are all busy, wait for one to go idle (the load waits, other models serve on)."""
        budget = self.settings.max_memory_bytes
        if budget is None:
            return
        if self._changed is None:
            self._changed = asyncio.Condition()
        while self.used_bytes + need > budget:
            idle = [o for o in self.entries.values()
                    if o is not e and o.status == LOADED and o.holds == 0 and not o.pinned]
            if idle:
                await self._unload(min(idle, key=lambda o: o.last_used))
                continue
            async with self._changed:
                await self._changed.wait()

    async def _unload(self, e: ModelEntry) -> None:
        if e._unloading is not None:
            await asyncio.shield(e._unloading)
            return
        if e.status != LOADED:
            return
        engine = e.engine
        self._cancel_timer(e)
        e.status, e.engine, e.state = UNLOADED, None, None
        e.loaded_at = None
        e._unloading = asyncio.ensure_future(asyncio.to_thread(engine.shutdown))  # type: ignore[union-attr]
        try:
            await asyncio.shield(e._unloading)
        finally:
            e._unloading = None
            self._notify()
        log.info("model %s unloaded", e.name)

    def _died(self, e: ModelEntry, engine: AsyncEngine, err: EngineDeadError) -> None:
        """A loaded model's core failed: its requests have had the error; the model is unloaded, and its
        next request loads it again. The other models serve on."""
        if e.engine is not engine:
            return
        e.last_error = str(err)
        log.error("model %s's engine failed (%s); it is unloaded", e.name, err)
        asyncio.ensure_future(self._unload(e))

    # --- idle clocks ------------------------------------------------------------------------------
    def _idle(self, e: ModelEntry) -> None:
        if e.status != LOADED or e.pinned or self._closed:
            return
        keep = self.keep_alive_of(e)
        self._cancel_timer(e)
        if keep == FOREVER:
            return
        loop = asyncio.get_running_loop()
        if keep <= 0:
            asyncio.ensure_future(self._unload_if_idle(e))
        else:
            e._timer = loop.call_later(keep, lambda: asyncio.ensure_future(self._unload_if_idle(e)))

    async def _unload_if_idle(self, e: ModelEntry) -> None:
        if e.holds == 0 and e.status == LOADED and not e.pinned:
            await self._unload(e)

    @staticmethod
    def _cancel_timer(e: ModelEntry) -> None:
        if e._timer is not None:
            e._timer.cancel()
            e._timer = None

    def _notify(self) -> None:
        changed = self._changed
        if changed is not None:
            async def wake() -> None:
                async with changed:
                    changed.notify_all()
            asyncio.ensure_future(wake())

    # --- the server's life ------------------------------------------------------------------------
    async def preload(self, names: list[str]) -> None:
        for name in names:
            await self.load(name)

    def abort_all(self) -> None:
        """The drain's end (server/process.py): every loaded model's requests aborted."""
        for e in self.loaded():
            e.engine.abort_all()  # type: ignore[union-attr]

    def on_failure(self, callback: Callable[[EngineDeadError], None]) -> None:
        """process.py's hook. A one-model server stops when its engine fails (as it always has); with many
        models a failed engine only unloads its model (`_died`)."""
        single = self.entries[self.default]
        if single.pinned and single.engine is not None:
            single.engine.on_failure(callback)

    async def close(self) -> None:
        """Every engine this pool started shut down (a pinned one belongs to its caller)."""
        self._closed = True
        for e in self.entries.values():
            self._cancel_timer(e)
        for e in list(self.entries.values()):
            if e._loading is not None:
                await asyncio.gather(asyncio.shield(e._loading), return_exceptions=True)
            if not e.pinned:
                await self._unload(e)
        if self._launcher is not None:  # after the cores it started: they leave when it does
            await asyncio.to_thread(self._launcher.close)

    def _launch_core(self, config: EngineConfig, tokenizer: Any) -> AsyncEngine:
        """The default `launch` (on a worker thread; loads go one at a time): from the pool's launcher."""
        if self._launcher is None:
            self._launcher = core_launcher.start()
        return _launch(config, tokenizer, self._launcher)

    # --- what /v1/models, Ollama's ps and /metrics show -------------------------------------------
    def describe(self, e: ModelEntry) -> dict[str, Any]:
        """A model's extra fields in /v1/models (OpenAI's client keeps unknown fields)."""
        out: dict[str, Any] = {"state": e.status, "memory_bytes": e.bytes or None,
                               "estimated_memory_bytes": e.estimate_bytes}
        if e.status == LOADED:
            out["load_seconds"] = round(e.load_seconds, 3) if e.load_seconds is not None else None
            expires = self.expires_at(e)
            out["expires_at"] = int(expires) if expires is not None else None
        if e.last_error:
            out["last_error"] = e.last_error
        return out


def _launch(config: EngineConfig, tokenizer: Any, launcher: CoreLauncher | None) -> AsyncEngine:
    """AsyncEngine.launch, or with a tokenizer already loaded, the same core process started alone;
    forked from `launcher`."""
    from ruvllm.engine.async_engine import AsyncEngine
    from ruvllm.engine.core_client import ProcessCoreClient

    if tokenizer is None:
        return AsyncEngine.launch(config, launcher=launcher)
    client = ProcessCoreClient(config, launcher=launcher)
    try:
        client.wait_ready()
    except BaseException:
        client.shutdown()
        raise
    return AsyncEngine(client, tokenizer)


class PoolCollector(Collector):
    """/metrics: each model's state and memory, read from the pool at scrape time (loads nothing)."""

    def __init__(self, pool: ModelPool) -> None:
        self.pool = pool

    def collect(self) -> Iterator[Any]:
        loaded = GaugeMetricFamily("ruvllm:model_loaded", "1 while the model is loaded (0: unloaded or loading).",
                                   labels=["model_name"])
        loading = GaugeMetricFamily("ruvllm:model_loading", "1 while the model is loading.", labels=["model_name"])
        memory = GaugeMetricFamily("ruvllm:model_memory_bytes", "Weights + KV cache of the model (loaded: as "
                                   "loaded; loading: as estimated; unloaded: 0).", labels=["model_name"])
        for e in self.pool.entries.values():
            loaded.add_metric([e.name], 1.0 if e.status == LOADED else 0.0)
            loading.add_metric([e.name], 1.0 if e.status == LOADING else 0.0)
            memory.add_metric([e.name], float(e.bytes))
        yield from (loaded, loading, memory)


HOLDS_KEY = "ruvllm_model_holds"


class ModelHolds:
    """Releases the models a request was routed to once its response has ended (its last byte sent, a
    stream's included): until then the model is busy, so neither keep_alive nor a load's need for memory
    unloads it under the request. A pure ASGI middleware, as guards.py's are."""

    def __init__(self, app: ASGIApp, pool: ModelPool) -> None:
        self.app, self.pool = app, pool

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        held: list[str] = []
        scope.setdefault("state", {})[HOLDS_KEY] = held
        try:
            await self.app(scope, receive, send)
        finally:
            for name in held:
                self.pool.release(name)


def read_models_file(path: str | Path) -> list[tuple[str, str]]:
    """`NAME=SOURCE` per line (blank lines and `#` comments skipped), as `--model` takes them."""
    out = []
    for i, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        try:
            out.append(parse_model_spec(line))
        except ValueError as exc:
            raise ValueError(f"{path}, line {i}: {exc}") from None
    return out


def parse_model_spec(spec: str) -> tuple[str, str]:
    name, sep, source = spec.partition("=")
    name, source = name.strip(), source.strip()
    if not sep or not name or not source:
        raise ValueError(f"a model is NAME=SOURCE (a path, an alias or a Hub id), got {spec!r}")
    return name, source


__all__ = ["FOREVER", "LOADED", "LOADING", "UNLOADED", "ModelEntry", "ModelHolds", "ModelPool", "PoolCollector",
           "PoolSettings", "estimate_bytes", "keep_alive_seconds", "parse_model_spec", "read_models_file"]
