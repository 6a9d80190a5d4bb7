"""OpenAI's API: chat and text completions, models, and vLLM's tokenize/detokenize. A translation only:
the request body into prompts and SamplingParams for the generation service, its outputs into
OpenAI's bodies (responses.py)."""

from __future__ import annotations

import asyncio
from functools import partial
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response

from ruvllm.server import responses as R
from ruvllm.server.adapters import check_operator
from ruvllm.server.errors import APIError
from ruvllm.server.generation import EnginePrompt, ServerState, check_context, state
from ruvllm.server.model_pool import ModelPool
from ruvllm.server.protocol import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest
from ruvllm.server.reasoning import after_reasoning, thinking_of
from ruvllm.server.tenants import tenant_of
from ruvllm.tenants import may_use
from ruvllm.tools.format import ToolUse
from ruvllm.tools.parsers import JsonCallParser

router = APIRouter()


@router.get("/v1/models")
async def models(request: Request) -> dict[str, Any]:
    """Every model, and the loaded adapters of each. Nothing is loaded to answer. On a many-model server
    each model carries its state and memory (server/model_pool.py's `describe`: extra fields, which
    OpenAI's client keeps)."""
    # The operator's names, never a filesystem path of the host (nor an adapter's); of learned
    # adapters, only the asking tenant's own.
    pool: ModelPool = request.app.state.models
    tenant = tenant_of(request, None)
    data = []
    for e in pool.entries.values():
        st = e.state
        base = {"id": e.name, "object": "model", "created": st.created if st else pool.created, "owned_by": "ruvllm",
                "max_model_len": st.max_len if st else None, "root": e.name, "parent": None}
        if pool.single is None:
            base.update(pool.describe(e))
        data.append(base)
        if st is not None:
            data += [{**base, "id": lora, "root": lora, "parent": e.name} for lora in st.engine.loras
                     if may_use(tenant, lora)]
    return {"object": "list", "data": data}


def _operator(request: Request) -> None:
    check_operator(request, request.app.state.server_cfg)


def _entry(request: Request, name: str) -> ModelPool:
    pool: ModelPool = request.app.state.models
    if name not in pool.entries:
        served = ", ".join(f"`{m}`" for m in pool.entries)
        raise APIError(404, f"The model `{name}` does not exist. This server serves {served}.", "model",
                       "model_not_found")
    return pool


@router.post("/v1/models/{name:path}/load", dependencies=[Depends(_operator)])
async def load_model(name: str, request: Request) -> dict[str, Any]:
    """Admin: load now (waits for the load; its idle clock starts when it ends)."""
    pool = _entry(request, name)
    return {"id": name, "object": "model", **pool.describe(await pool.load(name))}


@router.post("/v1/models/{name:path}/unload", dependencies=[Depends(_operator)])
async def unload_model(name: str, request: Request) -> dict[str, Any]:
    """Admin: unload now; a model with requests running unloads as soon as they end."""
    pool = _entry(request, name)
    return {"id": name, "object": "model", **pool.describe(await pool.unload(name))}


@router.post("/tokenize")
async def tokenize(body: TokenizeRequest, request: Request, st: ServerState = Depends(state)) -> dict[str, Any]:
    st.check_model(body.model, tenant_of(request, None))
    if (body.prompt is None) == (body.messages is None):
        raise APIError(400, "give exactly one of prompt or messages", "prompt")
    if body.messages is not None:
        ids = await _chat_ids(st, body.messages, body.add_generation_prompt)
    else:
        ids = await _off_loop(st.engine.tokenizer.encode, body.prompt, add_special_tokens=body.add_special_tokens)
    return {"count": len(ids), "max_model_len": st.max_len, "tokens": ids}


@router.post("/detokenize")
async def detokenize(body: DetokenizeRequest, request: Request, st: ServerState = Depends(state)) -> dict[str, Any]:
    st.check_model(body.model, tenant_of(request, None))
    vocab = st.engine.info.vocab_size
    bad = [t for t in body.tokens if not 0 <= t < vocab]
    if bad:
        raise APIError(400, f"token ids out of range [0, {vocab}): {bad[:5]}", "tokens")
    return {"prompt": await _off_loop(st.engine.tokenizer.decode, body.tokens)}


@router.post("/v1/chat/completions")
async def chat(body: ChatCompletionRequest, request: Request, st: ServerState = Depends(state)) -> Response:
    lora = st.check_model(body.model, tenant_of(request, body.user))
    body.check_supported()
    tools = ToolUse.from_request(body.tools, body.tool_choice, body.parallel_tool_calls)
    prompt = EnginePrompt(await _chat_ids(st, body.messages, body.add_generation_prompt, tools, body.template_vars()), None)
    max_tokens = check_context(prompt, body.token_limit, st.max_len)
    top_n = body.top_logprobs or 0
    params = body.sampling_params(max_tokens, logprobs=top_n if body.logprobs else None,
                                  tool_constraint=None if tools is None else tools.constraint())
    thinking = await thinking_of(st, prompt.token_ids)
    params = after_reasoning(st, params, thinking)
    reader = None
    if tools is not None and tools.active:
        reader = JsonCallParser() if tools.constrained else st.tool_parser
    return await st.serve(request, [prompt], [params], "chatcmpl-", lora,
                          partial(R.chat_chunks, st, body, reader, thinking=thinking),
                          partial(R.chat_body, st, body, reader, thinking=thinking), user=body.user,
                          stream=body.stream, priority=body.priority)


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request, st: ServerState = Depends(state)) -> Response:
    lora = st.check_model(body.model, tenant_of(request, body.user))
    body.check_supported()
    prompts = [EnginePrompt(await _off_loop(st.engine.tokenizer.encode, p), p) if isinstance(p, str)
               else EnginePrompt(list(p), None) for p in body.prompts()]
    budgets = [check_context(p, body.token_limit, st.max_len) for p in prompts]
    echo_lp = body.echo and body.logprobs is not None
    params = [body.sampling_params(b, logprobs=body.logprobs, prompt_logprobs=body.logprobs if echo_lp else None)
              for b in budgets]
    return await st.serve(request, prompts, params, "cmpl-", lora, partial(R.completion_chunks, st, body, prompts),
                          partial(R.completion_body, st, body, prompts), user=body.user, stream=body.stream,
                          priority=body.priority)


async def _off_loop(fn: Any, *args: Any, **kwargs: Any) -> Any:
    """Tokenizing a long text takes long: on a worker thread the event loop keeps answering meanwhile
    (the tokenizers library releases the interpreter lock while it works)."""
    out = await asyncio.to_thread(fn, *args, **kwargs)
    return list(out) if not isinstance(out, str) else out


async def _chat_ids(st: ServerState, messages: list[Any], add_generation_prompt: bool,
                    tools: ToolUse | None = None, variables: dict[str, Any] | None = None) -> list[int]:
    msgs = [{"role": m.role, "content": m.text(), **({"name": m.name} if m.name else {}),
             **{key: value for key in ("tool_calls", "tool_call_id") if (value := (m.model_extra or {}).get(key))}}
            for m in messages]
    return await st.chat_prompt(msgs, tools, "messages", variables, add_generation_prompt)
