"""The gRPC API's methods (ruvllm.proto's `Generation` service) over the server's generation service:
the same ServerState as the HTTP routers (admission, tenants, adapters by model name, the prefix-cache
salt, the learning recorder, metrics labelled by the method), only another wire."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

import grpc

from ruvllm.grpc import ruvllm_pb2 as pb
from ruvllm.grpc.translate import (finish_of, priority_of, prompt_of, sampling_params, token_limit, usage_of,
                                   user_of)
from ruvllm.server.errors import APIError, api_error
from ruvllm.server.config import ServerConfig
from ruvllm.server.generation import Run, ServerState, check_context
from ruvllm.server.model_pool import ModelPool
from ruvllm.server.guards import KeyTable, key_roles
from ruvllm.server.tenants import tenant_named
from ruvllm.tenants import may_use

log = logging.getLogger(__name__)

SERVICE = "ruvllm.v1.Generation"
# What each HTTP status of errors.py's table is in gRPC (anything else: INTERNAL)
_CODES = {400: grpc.StatusCode.INVALID_ARGUMENT, 401: grpc.StatusCode.UNAUTHENTICATED,
          403: grpc.StatusCode.PERMISSION_DENIED, 404: grpc.StatusCode.NOT_FOUND,
          408: grpc.StatusCode.DEADLINE_EXCEEDED, 413: grpc.StatusCode.RESOURCE_EXHAUSTED,
          429: grpc.StatusCode.RESOURCE_EXHAUSTED, 503: grpc.StatusCode.UNAVAILABLE}


def method(name: str) -> str:
    """A method's full name: what --route-without-key names and what metrics label it by."""
    return f"/{SERVICE}/{name}"


class Malformed:
    """A request whose bytes are no message of its type: answered INVALID_ARGUMENT by its method
    (a deserializer that raised would be gRPC's INTERNAL, as if the server were at fault)."""

    def __init__(self, error: str) -> None:
        self.error = error


def status_of(exc: BaseException) -> tuple[grpc.StatusCode, str, tuple[tuple[str, str], ...]]:
    """An error as gRPC's status: code, message and trailing metadata (429's retry-after)."""
    err = api_error(exc)
    if err.status == 500 and err.code is None:  # not raised on purpose
        log.error("gRPC call failed", exc_info=exc)
    trailers = tuple((k.lower(), v) for k, v in (err.headers or {}).items() if k.lower() == "retry-after")
    return _CODES.get(err.status, grpc.StatusCode.INTERNAL), err.message, trailers


async def _abort(context: grpc.aio.ServicerContext, exc: BaseException) -> None:
    code, message, trailers = status_of(exc)
    await context.abort(code, message, trailers)  # raises: the call ends here


class GenerationAPI:
    def __init__(self, pool: ModelPool, cfg: ServerConfig) -> None:
        """`pool`: the server's models (server/model_pool.py); a call goes to the model its `model` names,
        as an HTTP request does, and holds it until the call ends."""
        self.pool = pool
        self.keys = KeyTable(key_roles(cfg))
        self.required = bool(cfg.api_key or cfg.api_keys)
        self.open_methods = frozenset(cfg.routes_without_key)  # full method names, as HTTP paths are

    def _key_tenant(self, context: grpc.aio.ServicerContext, name: str) -> str | None:
        """The tenant the caller's key names (None: no key, or one that lets `user` say), read as HTTP
        reads it: `authorization: Bearer <key>` or `x-api-key: <key>` metadata. UNAUTHENTICATED when
        keys are required and this one is missing or unknown."""
        metadata = {k.lower(): v for k, v in context.invocation_metadata() or () if isinstance(v, str)}
        scheme, _, token = metadata.get("authorization", "").strip().partition(" ")
        if scheme.lower() != "bearer":
            token = metadata.get("x-api-key", "")
        role = self.keys.role(token.encode()) if token else None
        if role is None and self.required and method(name) not in self.open_methods:
            raise APIError(401, "invalid or missing API key (send the metadata 'authorization: Bearer <key>')",
                           None, "invalid_api_key")
        return None if role is None else role[0]

    async def _begin(self, req: pb.GenerateRequest | Malformed, context: grpc.aio.ServicerContext,
                     name: str) -> tuple[Run, ServerState, str | None]:
        """The call's run, its model's state and the model it holds (None: a one-model server's, never
        released); the caller releases both however the call ends."""
        key_tenant = self._key_tenant(context, name)  # before anything of the request is read
        if isinstance(req, Malformed):
            raise APIError(400, f"the request is not a GenerateRequest: {req.error}", None, "invalid_value")
        st, held = await self._route(req.model or None)
        try:
            tenant = tenant_named(key_tenant, user_of(req))
            adapter = st.check_model(req.model or None, tenant)
            priority = priority_of(req)
            prompt = await prompt_of(st, req)
            params = sampling_params(req, check_context(prompt, token_limit(req), st.max_len))
            return await st.begin(method(name), tenant, [prompt], [params], "gen-", adapter, priority), st, held
        except BaseException:
            self._release(held)
            raise

    async def _route(self, model: str | None) -> tuple[ServerState, str | None]:
        single = self.pool.single
        if single is not None:
            return single, None
        name = self.pool.resolve(model)
        return await self.pool.acquire(name), name

    def _release(self, held: str | None) -> None:
        if held is not None:
            self.pool.release(held)

    async def generate(self, req: pb.GenerateRequest | Malformed,
                       context: grpc.aio.ServicerContext) -> pb.GenerateResponse:
        try:
            run, st, held = await self._begin(req, context, "Generate")
            try:
                # a cancelled call (client gone, deadline) raises here, which aborts the engine requests
                async with aclosing(run.following):
                    async for _ in run.following:
                        pass
                results = run.finish()
            finally:
                st.admission.release(run.seqs)
                self._release(held)
        except Exception as exc:
            await _abort(context, exc)
        c = results[0].outputs[0]
        reason, stop = finish_of(c)
        return pb.GenerateResponse(id=run.id, model=run.model, text=c.text, token_ids=c.token_ids,
                                   finish_reason=reason, stop_sequence=stop, usage=usage_of(results))

    async def generate_stream(self, req: pb.GenerateRequest | Malformed,
                              context: grpc.aio.ServicerContext) -> AsyncIterator[pb.GenerateChunk]:
        try:
            run, st, held = await self._begin(req, context, "GenerateStream")
        except Exception as exc:
            await _abort(context, exc)
        try:
            async with aclosing(run.following):  # however the call ends, the engine requests end with it
                async for _, out in run.following:
                    for c in out.outputs:
                        if c.text or c.token_ids:  # text held back (a stop string's prefix) comes later
                            yield pb.GenerateChunk(id=run.id, model=run.model, text=c.text, token_ids=c.token_ids)
            results = run.finish()
            reason, stop = finish_of(results[0].outputs[0])
            yield pb.GenerateChunk(id=run.id, model=run.model, finish_reason=reason, stop_sequence=stop,
                                   usage=usage_of(results))
        except Exception as exc:  # mid-stream: the chunks sent stand, the status says why no more come
            await _abort(context, exc)
        finally:
            st.admission.release(run.seqs)
            self._release(held)

    async def list_models(self, req: pb.ListModelsRequest | Malformed,
                          context: grpc.aio.ServicerContext) -> pb.ListModelsResponse:
        # As /v1/models: the operator's names, never a path; of learned adapters, only the caller's own
        try:
            tenant = tenant_named(self._key_tenant(context, "ListModels"), None)
        except Exception as exc:
            await _abort(context, exc)
        models = []
        for e in self.pool.entries.values():  # every model, loaded or not (nothing is loaded to answer)
            st = e.state
            if st is None:
                models.append(pb.Model(id=e.name, created=self.pool.created))
                continue
            models.append(pb.Model(id=e.name, max_model_len=st.max_len, created=st.created))
            models += [pb.Model(id=lora, parent=e.name, max_model_len=st.max_len, created=st.created)
                       for lora in st.engine.loras if may_use(tenant, lora)]
        return pb.ListModelsResponse(models=models)

    async def health(self, req: Any, context: grpc.aio.ServicerContext) -> pb.HealthResponse:
        """As /health, and like it answered without a key: a probe holds no secret. With several models
        the server serves while it runs (a model whose engine failed is unloaded, the others serve on)."""
        single = self.pool.single
        if single is None:
            return pb.HealthResponse(status=pb.HealthResponse.SERVING)
        engine = single.engine
        if engine.failure is not None:
            return pb.HealthResponse(status=pb.HealthResponse.NOT_SERVING,
                                     detail=f"engine is not running: {engine.failure}")
        if not engine.is_alive:
            return pb.HealthResponse(status=pb.HealthResponse.NOT_SERVING, detail="engine is not running")
        return pb.HealthResponse(status=pb.HealthResponse.SERVING)
