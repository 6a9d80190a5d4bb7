"""Ollama's model routes: /api/tags, /api/show, /api/ps, /api/version and /api/pull.

What they say about a model is its card (ollama_card.py: read once from its files' headers). LoRA
adapters are listed beside the base model (a tenant sees only its own learned ones); the front knows
them by name only, so their entries carry no size, digest or date.

/api/pull downloads into the model cache (ollama_pull.py), as `ruvllm download` does; what it fetches
is served by a server started on it (`ruvllm serve NAME`), not by this one.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import StreamingResponse
from starlette.routing import Match

from ruvllm import __version__
from ruvllm.server.adapters import operator_only
from ruvllm.server.errors import OLLAMA
from ruvllm.server.generation import ServerState, state
from ruvllm.server.model_pool import ModelPool
from ruvllm.server.ollama_card import ModelCard, card, card_named, file_card, rfc3339
from ruvllm.server.ollama_protocol import PullRequest, ShowRequest, resolve_model, served_name
from ruvllm.server.ollama_pull import Line, pull_error, start_download
from ruvllm.server.tenants import tenant_of
from ruvllm.tenants import may_use

router = APIRouter()

# /api/ps's expires_at for a model that is never unloaded (Ollama's own answer for keep_alive -1 is
# as far off): the served model stays loaded as long as the server runs.
NEVER = "9999-12-31T23:59:59Z"


def _visible_adapters(request: Request, st: ServerState) -> list[str]:
    tenant = tenant_of(request, None)
    return [a for a in st.engine.loras if may_use(tenant, a)]


def _entry(name: str, c: ModelCard, base: str | None) -> dict[str, Any]:
    """One model as /api/tags lists it; an adapter (`base` set) with its base model's details."""
    if base is not None:
        return {"name": name, "model": name, "details": c.details(parent=base)}
    return {"name": name, "model": name, "modified_at": c.modified_at, "size": c.size, "digest": c.digest,
            "details": c.details()}


def _ps_entry(name: str, c: ModelCard, st: ServerState, expires_at: str) -> dict[str, Any]:
    info = st.engine.info
    memory = info.weight_bytes + info.kv_cache_bytes  # the weights as loaded and the KV pool
    on_gpu = info.device.startswith("cuda")
    base = {**_entry(name, c, None), "size": memory, "size_vram": memory if on_gpu else 0, "expires_at": expires_at,
            "context_length": st.max_len}
    base.pop("modified_at")
    return base


@router.get("/api/tags")
async def tags(request: Request) -> dict[str, Any]:
    """Every model the server serves (loaded or not: nothing is loaded to answer) and the loaded adapters."""
    pool: ModelPool = request.app.state.models
    out = []
    for e in pool.entries.values():
        st = e.state
        try:
            c = await (card(request, st) if st is not None else card_named(request, e.name,
                                                                             lambda e=e: file_card(e.config)))
        except Exception:  # a model whose files cannot be read (it fails to load too): its name only
            out.append({"name": e.name, "model": e.name})
            continue
        out.append(_entry(e.name, c, None))
        if st is not None:
            out += [_entry(a, c, e.name) for a in _visible_adapters(request, st)]
    return {"models": out}


@router.get("/api/ps")
async def ps(request: Request) -> dict[str, Any]:
    """The loaded models, each with when it unloads if left idle (keep_alive)."""
    pool: ModelPool = request.app.state.models
    out = []
    for e in pool.loaded():
        st = e.state
        if st is None:
            continue
        c = await card(request, st)
        expires = pool.expires_at(e)
        base = _ps_entry(e.name, c, st, rfc3339(expires) if expires is not None else NEVER)
        out.append(base)
        out += [{**_entry(a, c, e.name), "expires_at": base["expires_at"], "context_length": st.max_len}
                for a in _visible_adapters(request, st)]
    return {"models": out}


@router.get("/api/version")
async def version() -> dict[str, str]:
    return {"version": __version__}


def capabilities(request: Request, st: ServerState) -> list[str]:
    """What the model can do here. Tools work with any model (tools/format.py writes them into the
    prompt of a template that knows none); embedding only where the app serves Ollama's embed route;
    thinking where the model thinks (its reasoning is served apart: server/reasoning.py)."""
    caps = ["completion", "tools"]
    if st.reasoning is not None:
        caps.append("thinking")
    # asked of the routes themselves (FastAPI keeps an included router as one entry, not its paths)
    scope = {"type": "http", "path": "/api/embed", "method": "POST", "root_path": "", "path_params": {},
             "app": request.app}
    if any(route.matches(scope)[0] == Match.FULL for route in request.app.router.routes):
        caps.append("embedding")
    return caps


@router.post("/api/show")
async def show(body: ShowRequest, request: Request, st: ServerState = Depends(state)) -> dict[str, Any]:
    name = body.which
    adapter = resolve_model(st, name, tenant_of(request, None))
    c = await card(request, st)
    template = st.cfg.chat_template or getattr(st.engine.tokenizer, "chat_template", None) or ""
    return {"license": c.license, "template": template, "parameters": f"num_ctx {st.max_len}",
            "details": c.details(parent=st.cfg.served_model_name if adapter else ""), "model_info": c.model_info,
            "capabilities": capabilities(request, st), "modified_at": c.modified_at}



def _line(obj: dict[str, Any]) -> str:
    return json.dumps(obj, ensure_ascii=False) + "\n"


@router.post("/api/pull", dependencies=[Depends(operator_only)])
async def pull(body: PullRequest, request: Request, st: ServerState = Depends(state)) -> Any:
    from ruvllm.loader import hub, model_cache

    name = served_name(body.which)
    if name in (st.cfg.served_model_name, model_cache.DEFAULT_NAME):  # here already (the default is embedded)
        return StreamingResponse(iter([_line({"status": "success"})]), media_type=OLLAMA.stream_media_type) \
            if body.stream else {"status": "success"}
    try:
        base, tag = hub.requested(name, None)
        model_cache.hub_id(base)  # a name that is neither an alias nor owner/name: no lookup at all
    except ValueError as exc:
        raise pull_error(exc) from None

    task, lines = start_download(request, name)
    first = await lines.get()  # a failure before any file arrives still gets its status line
    if isinstance(first, BaseException):
        raise pull_error(first)
    if not body.stream:
        while first is not None:
            if isinstance(first, BaseException):
                raise pull_error(first)
            first = await lines.get()
        await task
        return {"status": "success"}

    async def stream() -> AsyncIterator[str]:
        item: Line = first
        yield _line({"status": "pulling manifest"})
        while item is not None:
            if isinstance(item, BaseException):
                err = pull_error(item)
                yield _line(OLLAMA.body(err.status, err.message, err.param, err.code))
                return
            yield _line(item)
            item = await lines.get()
        yield _line({"status": "success"})

    return StreamingResponse(stream(), media_type=OLLAMA.stream_media_type)
