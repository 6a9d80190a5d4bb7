"""The HTTP server over an AsyncEngine (FastAPI): one router per concern (openai_api.py, adapters.py,
feedback.py, health.py) over one generation service (engine/generation.py, with the server's side in
generation.py). Handlers only validate, submit, await and abort: the engine owns the model."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI

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
from ruvllm.server.reasoning import reasoning_end_ids
from ruvllm.tools.format import template_knows_tools
from ruvllm.tools.parsers import parser_for
from ruvllm.tools.reasoning import tags_for


def create_app(engine: AsyncEngine, cfg: ServerConfig, owns_engine: bool = False) -> FastAPI:
    service = GenerationService(model_name=cfg.served_model_name, witness_store_tokens=cfg.witness_store_tokens)
    if cfg.witness_log:
        from ruvllm.witness.log import WitnessLog
        from ruvllm.witness.records import model_digest

        service.witness = WitnessLog(cfg.witness_log, model_digest=lambda: model_digest(engine.info.model),
                                     key_file=cfg.witness_key_file)
    st = ServerState(engine, cfg, ServerMetrics(lambda: engine.replicas, cfg.served_model_name),
                     Admission(engine.info.max_num_seqs + cfg.max_queue), service, R.token_text(engine.tokenizer),
                     int(time.time()))
    if cfg.learning is not None:
        service.learner = GenerationService.new_learner(engine, engine.info.model, engine.tokenizer,
                                                        engine.info.eos_token_ids, cfg.learning)
        st.feedback = feedback.Feedback(cfg, engine.info.model, service.learner.root, cfg.learning.nice)
    template = cfg.chat_template or getattr(engine.tokenizer, "chat_template", None)
    st.native_tools = template_knows_tools(template)
    st.tool_parser = parser_for(template, cfg.tool_parser)  # stateless: one serves every request
    st.reasoning = tags_for(template, cfg.reasoning_tags)
    st.reasoning_end_ids = reasoning_end_ids(engine.tokenizer, st.reasoning)

    @asynccontextmanager
    async def lifespan(running: FastAPI) -> AsyncIterator[None]:
        grpc_server = None
        if cfg.grpc_port is not None:  # on this event loop, over the same state (docs/server.md, "gRPC")
            from ruvllm.grpc.server import start_grpc

            grpc_server, running.state.grpc_port = await start_grpc(st, cfg.host, cfg.grpc_port)
        yield
        if grpc_server is not None:  # refuses new calls; those in flight get the drain's time
            await grpc_server.stop(cfg.graceful_shutdown_s)
        if service.learner is not None:
            await st.feedback.close()
            await asyncio.to_thread(service.learner.close)  # its background pass may be loading into the engine
        if owns_engine:
            engine.shutdown()  # aborts what is still in flight, so every block returns
        if service.witness is not None:
            service.witness.close()  # what is queued is committed first

    app = FastAPI(title="ruvllm", lifespan=lifespan)
    app.state.ruvllm = st
    app.state.responses_store = responses_api.new_store(cfg)  # /v1/responses' stored responses, per tenant
    install_error_handlers(app)
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
