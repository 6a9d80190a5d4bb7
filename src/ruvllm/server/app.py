"""The HTTP server over an AsyncEngine (FastAPI): one router per concern (openai_api.py, adapters.py,
feedback.py, health.py) over one generation service (engine/generation.py, with the server's side in
generation.py). Handlers only validate, submit, await and abort: the engine owns the model."""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

from fastapi import FastAPI

from ruvllm.config import EngineConfig
from ruvllm.engine.async_engine import AsyncEngine
from ruvllm.engine.generation import GenerationService
from ruvllm.server import adapters, anthropic_api, embeddings, feedback, health, ollama_api, openai_api, responses_api
from ruvllm.server import rerank
from ruvllm.server import responses as R
from ruvllm.server.config import ServerConfig
from ruvllm.server.errors import install_error_handlers
from ruvllm.server.generation import Admission, ServerState
from ruvllm.server.guards import APIKeyMiddleware, RequestLimitsMiddleware, key_roles
from ruvllm.server.metrics import ServerMetrics
from ruvllm.server.model_pool import ModelHolds, ModelPool, PoolCollector, PoolSettings
from ruvllm.server.reasoning import reasoning_end_ids
from ruvllm.tools.format import template_knows_tools
from ruvllm.tools.parsers import parser_for
from ruvllm.tools.reasoning import tags_for


def create_app(engine: AsyncEngine, cfg: ServerConfig, owns_engine: bool = False) -> FastAPI:
    """One model (`ruvllm serve MODEL`): its engine, loaded by the caller, serves every request."""
    service = GenerationService(model_name=cfg.served_model_name, witness_store_tokens=cfg.witness_store_tokens)
    if cfg.witness_log:
        service.witness = _witness_log(cfg.witness_log, cfg, engine)
    metrics = ServerMetrics(lambda: engine.replicas, cfg.served_model_name)
    st = model_state(engine, cfg, metrics, service, int(time.time()))
    if cfg.learning is not None:
        service.learner = GenerationService.new_learner(engine, engine.info.model, engine.tokenizer,
                                                        engine.info.eos_token_ids, cfg.learning)
        st.feedback = feedback.Feedback(cfg, service, engine.info.model, service.learner.root, cfg.learning.nice)

    async def stop() -> None:
        if service.learner is not None:
            await st.feedback.close()
            await asyncio.to_thread(service.learner.close)  # its background pass may be loading into the engine
        if owns_engine:
            engine.shutdown()  # aborts what is still in flight, so every block returns
        if service.witness is not None:
            service.witness.close()  # what is queued is committed first

    async def start() -> None:
        if owns_engine:  # it lives and ends with this app: its outputs are read on the app's loop
            await engine.read_outputs_here()

    app = _assemble(ModelPool.of_one(cfg.served_model_name, engine, st), cfg, metrics, start, stop)
    app.state.ruvllm = st
    return app


def create_pool_app(models: dict[str, EngineConfig], cfg: ServerConfig, settings: PoolSettings,
                    preload: tuple[str, ...] = (), launch: Callable[[EngineConfig, Any], AsyncEngine] | None = None
                    ) -> FastAPI:
    """Many models (docs/server.md, "Many models"): each an engine core in a process of its own, loaded on
    demand (or at start: `preload`) and unloaded when idle or short of memory (server/model_pool.py).
    Learning stays a one-model feature."""
    if cfg.learning is not None:
        raise ValueError("learning (--learn) serves one model; it is not available with several models")
    unknown = [name for name in preload if name not in models]
    if unknown:
        raise ValueError(f"--preload {unknown[0]}: no such model (the models are {', '.join(models)})")
    created = int(time.time())
    pool: ModelPool | None = None
    metrics = ServerMetrics(lambda: [], next(iter(models)),
                            models=lambda: [(e.name, e.engine.replicas) for e in pool.loaded()])  # type: ignore[union-attr]
    witnesses: dict[str, Any] = {}  # one log per model (a log stamps one model's digest), kept across reloads

    def make_state(name: str, engine: AsyncEngine) -> ServerState:
        model_cfg = replace(cfg, served_model_name=name)
        service = GenerationService(model_name=name, witness_store_tokens=cfg.witness_store_tokens)
        if cfg.witness_log:
            if name not in witnesses:
                witnesses[name] = _witness_log(_model_witness_path(cfg.witness_log, name), cfg, engine)
            service.witness = witnesses[name]
        return model_state(engine, model_cfg, metrics.for_model(name), service, created)

    pool = ModelPool(models, settings, make_state, launch)
    metrics.registry.register(PoolCollector(pool))

    async def start() -> None:
        await pool.preload(list(preload))  # uvicorn accepts nothing until these are loaded

    async def stop() -> None:
        await pool.close()
        for log in witnesses.values():
            log.close()

    return _assemble(pool, cfg, metrics, start, stop)


def model_state(engine: AsyncEngine, cfg: ServerConfig, metrics: ServerMetrics, service: GenerationService,
                created: int) -> ServerState:
    """One loaded model's state: its engine, and what its chat template says (read once)."""
    st = ServerState(engine, cfg, metrics, Admission(engine.info.max_num_seqs + cfg.max_queue), service,
                     R.token_text(engine.tokenizer), created)
    template = cfg.chat_template or getattr(engine.tokenizer, "chat_template", None)
    st.native_tools = template_knows_tools(template)
    st.tool_parser = parser_for(template, cfg.tool_parser)  # stateless: one serves every request
    st.reasoning = tags_for(template, cfg.reasoning_tags)
    st.reasoning_end_ids = reasoning_end_ids(engine.tokenizer, st.reasoning)
    return st


def _witness_log(path: str, cfg: ServerConfig, engine: AsyncEngine) -> Any:
    from ruvllm.witness.log import WitnessLog
    from ruvllm.witness.records import model_digest

    return WitnessLog(path, model_digest=lambda: model_digest(engine.info.model), key_file=cfg.witness_key_file)


def _model_witness_path(path: str, name: str) -> str:
    """`witness.sqlite3` -> `witness.NAME.sqlite3` (NAME made safe as a file name)."""
    p = Path(path)
    safe = re.sub(r"[^A-Za-z0-9._-]", "_", name)
    return str(p.with_name(f"{p.stem}.{safe}{p.suffix}"))


def _assemble(pool: ModelPool, cfg: ServerConfig, metrics: ServerMetrics, start: Callable[[], Awaitable[None]],
              stop: Callable[[], Awaitable[None]]) -> FastAPI:
    @asynccontextmanager
    async def lifespan(running: FastAPI) -> AsyncIterator[None]:
        grpc_server = None
        if cfg.grpc_port is not None:  # on this event loop, over the same models
            from ruvllm.grpc.server import start_grpc

            grpc_server, running.state.grpc_port = await start_grpc(pool, cfg, cfg.host, cfg.grpc_port)
        try:
            await start()
            yield
        finally:
            if grpc_server is not None:  # refuses new calls; those in flight get the drain's time
                await grpc_server.stop(cfg.graceful_shutdown_s)
            await stop()

    app = FastAPI(title="ruvllm", lifespan=lifespan)
    app.state.models = pool
    app.state.server_cfg = cfg
    app.state.metrics = metrics
    app.state.responses_store = responses_api.new_store(cfg)  # /v1/responses' stored responses, per tenant
    install_error_handlers(app)
    if pool.single is None:  # many models: a request holds its model until its response has ended
        app.add_middleware(ModelHolds, pool=pool)
    # The last added runs first: the key is checked before a body is read.
    app.add_middleware(RequestLimitsMiddleware, max_body_bytes=cfg.max_request_bytes,
                       read_timeout_s=cfg.request_read_timeout_s)
    keys = key_roles(cfg)
    if keys:  # the chat page holds no data: it asks for the key and sends it with its API calls
        app.add_middleware(APIKeyMiddleware, keys=keys, open_paths=("/health", "/", *cfg.routes_without_key),
                           required=bool(cfg.api_key or cfg.api_keys))
    for module in (health, adapters, feedback, openai_api, embeddings, rerank, anthropic_api, ollama_api,
                   responses_api):
        app.include_router(module.router)
    return app
