"""Embeddings in three dialects over the engine's pooling path (AsyncEngine.embed): OpenAI's
`POST /v1/embeddings`, Ollama's `POST /api/embed` and its older `POST /api/embeddings`. A
translation only: each body into token ids for the generation service's `embed` (tenant, adapter by
model name, the tenant's prefix-cache salt), its vectors into the dialect's body. Errors take the
dialect's shape by path (errors.py: `/api/` is Ollama's).

An embedding call is not a generation: it never streams and has no completion to record, so it
runs here rather than through `ServerState.serve`, over the same pieces (admission, tenants,
metrics labelled by endpoint)."""

from __future__ import annotations

import asyncio
import base64
import time
from typing import Any, Literal, Union

import numpy as np
from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, Field, StrictInt

from ruvllm.outputs import EmbeddingOutput
from ruvllm.request import Priority
from ruvllm.server.errors import APIError
from ruvllm.server.generation import ServerState, state
from ruvllm.server.tenants import tenant_of

router = APIRouter()

MAX_INPUTS = 2048  # inputs in one OpenAI call (OpenAI's own limit)


class EmbeddingRequest(BaseModel):
    """OpenAI's body. Unknown fields are ignored, as clients built for other servers send some."""

    model_config = ConfigDict(extra="allow")
    input: Union[str, list[str], list[StrictInt], list[list[StrictInt]]]
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, ge=1)
    user: str | None = None
    priority: Literal["low", "normal", "high", "critical"] | None = None  # ruvllm's, as on completions


class OllamaEmbedRequest(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: str
    input: Union[str, list[str], None] = None
    truncate: bool = True
    dimensions: int | None = Field(None, ge=1)
    options: dict[str, Any] | None = None
    keep_alive: Union[float, str, None] = None  # the model stays loaded: accepted, nothing to do


class OllamaEmbeddingsRequest(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: str
    prompt: str | None = None
    options: dict[str, Any] | None = None
    keep_alive: Union[float, str, None] = None


@router.post("/v1/embeddings")
async def openai_embeddings(body: EmbeddingRequest, request: Request, st: ServerState = Depends(state)) -> Any:
    texts = _openai_inputs(body.input)
    _check_dimensions(body.dimensions, st, "dimensions")
    prompts = [await _tokens(st, x) if isinstance(x, str) else x for x in texts]
    for i, ids in enumerate(prompts):
        if not ids:
            raise APIError(400, f"input {i} is empty: every input needs at least one token", "input")
        if len(ids) > st.max_len:
            raise APIError(400, f"This model's maximum context length is {st.max_len} tokens, however input {i} "
                                f"has {len(ids)} tokens. Please reduce the input.", "input", "context_length_exceeded")
    outs = await _embed(st, request, prompts, body.model, body.user, body.priority)
    if outs is None:
        return Response(status_code=499)  # the client left; nobody reads this
    data = []
    for i, out in enumerate(outs):
        vector = _vector(out, body.dimensions)
        value: Any = base64.b64encode(vector.tobytes()).decode("ascii") if body.encoding_format == "base64" \
            else vector.tolist()
        data.append({"object": "embedding", "index": i, "embedding": value})
    tokens = sum(out.num_prompt_tokens for out in outs)
    return {"object": "list", "data": data, "model": body.model or st.cfg.served_model_name,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}


@router.post("/api/embed")
async def ollama_embed(body: OllamaEmbedRequest, request: Request, st: ServerState = Depends(state)) -> Any:
    start = time.monotonic()
    model = _ollama_model(body.model, st)
    texts = ([body.input] if body.input else []) if isinstance(body.input, str) else list(body.input or [])
    if not texts:  # as Ollama: no input loads the model (here: always loaded) and embeds nothing
        return {"model": body.model, "embeddings": []}
    _check_dimensions(body.dimensions, st, "dimensions")
    limit = _ollama_context(body.options, st)
    prompts = []
    for i, text in enumerate(texts):
        ids = await _tokens(st, text)
        if not ids:
            raise APIError(400, f"input {i} is empty")
        if len(ids) > limit:
            if not body.truncate:
                raise APIError(400, "the input length exceeds the context length")
            ids = ids[:limit]  # Ollama keeps the beginning
        prompts.append(ids)
    outs = await _embed(st, request, prompts, model, None, None)
    if outs is None:
        return Response(status_code=499)
    return {"model": body.model, "embeddings": [_vector(out, body.dimensions).tolist() for out in outs],
            "total_duration": int((time.monotonic() - start) * 1e9), "load_duration": 0,
            "prompt_eval_count": sum(out.num_prompt_tokens for out in outs)}


@router.post("/api/embeddings")
async def ollama_embeddings(body: OllamaEmbeddingsRequest, request: Request, st: ServerState = Depends(state)) -> Any:
    """Ollama's older call: one prompt, one vector (normalized here too; Ollama's is not). Too long a
    prompt is cut to the context, as Ollama's runner does."""
    model = _ollama_model(body.model, st)
    if not body.prompt:
        return {"embedding": []}
    ids = (await _tokens(st, body.prompt))[:_ollama_context(body.options, st)]
    if not ids:
        raise APIError(400, "prompt is empty", "prompt")
    outs = await _embed(st, request, [ids], model, None, None)
    if outs is None:
        return Response(status_code=499)
    return {"embedding": _vector(outs[0], None).tolist()}


# --- the call ------------------------------------------------------------------------------------------
async def _embed(st: ServerState, request: Request, prompts: list[list[int]], model: str | None, user: str | None,
                 priority: str | None) -> list[EmbeddingOutput] | None:
    """The inputs embedded under admission (at most the engine's running cap of them in the engine at
    once, so a large batch waits for slots of its own rather than being refused); None when the
    client left first (its requests are aborted)."""
    tenant = tenant_of(request, user)
    adapter = st.check_model(model, tenant)
    start = time.monotonic()
    outs = await st.admitted(request, len(prompts), "input", lambda slots: st.service.embed(
        st.engine, st.admission.next_id("embd-"), tenant, adapter, prompts, Priority[(priority or "normal").upper()],
        concurrency=slots))
    if outs is None:
        return None
    st.metrics.pooled(request.url.path, [out.num_prompt_tokens for out in outs], [out.queue_time for out in outs],
                      time.monotonic() - start)
    return outs


# --- translation helpers -------------------------------------------------------------------------------
def _openai_inputs(value: Any) -> list[Union[str, list[int]]]:
    """OpenAI's `input` as a list of inputs: a string, strings, one list of token ids, or several."""
    if isinstance(value, str):
        items: list[Any] = [value]
    elif value and isinstance(value[0], int):
        items = [value]
    else:
        items = list(value)
    if not items:
        raise APIError(400, "input must not be empty: give a string, a list of strings, or token ids", "input")
    if len(items) > MAX_INPUTS:
        raise APIError(400, f"input has {len(items)} items; at most {MAX_INPUTS} are embedded in one call", "input")
    return items


async def _tokens(st: ServerState, text: str) -> list[int]:
    """Tokenized off the event loop (a long text takes a while), as LLM.embed tokenizes it."""
    return list(await asyncio.to_thread(st.engine.tokenizer.encode, text, add_special_tokens=True))


def _check_dimensions(dimensions: int | None, st: ServerState, param: str) -> None:
    size = st.engine.info.hidden_size
    if dimensions is not None and dimensions > size:
        raise APIError(400, f"dimensions must be at most this model's embedding size ({size}), got {dimensions}", param)


def _vector(out: EmbeddingOutput, dimensions: int | None) -> np.ndarray:
    """The embedding as little-endian float32; with `dimensions`, its first ones renormalized to length 1."""
    v = np.asarray(out.embedding, dtype="<f4")
    if dimensions is not None and dimensions < v.shape[0]:
        v = v[:dimensions]
        norm = np.linalg.norm(v.astype(np.float64))
        if norm > 0:
            v = (v / norm).astype("<f4")
    return v


def _ollama_model(name: str, st: ServerState) -> str:
    """Ollama names carry a tag: `model:latest` is the model itself."""
    return name.removesuffix(":latest") if name.removesuffix(":latest") == st.cfg.served_model_name else name


def _ollama_context(options: dict[str, Any] | None, st: ServerState) -> int:
    """The tokens an input may have: options.num_ctx where it asks for less than the engine holds."""
    num_ctx = (options or {}).get("num_ctx")
    if num_ctx is None:
        return st.max_len
    if not isinstance(num_ctx, int) or isinstance(num_ctx, bool) or num_ctx < 1:
        raise APIError(400, f"options.num_ctx must be a positive whole number, got {num_ctx!r}", "options.num_ctx")
    return min(num_ctx, st.max_len)
