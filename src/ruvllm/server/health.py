"""The chat page, /health and /metrics: what a browser, a load balancer and Prometheus read."""

from __future__ import annotations

from importlib.resources import files
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse, Response
from prometheus_client import generate_latest

from ruvllm.server.errors import error_response
from ruvllm.server.model_pool import ModelPool

router = APIRouter()
_PAGE = files("ruvllm.server").joinpath("static/chat.html").read_text(encoding="utf-8")


def _wants_page(accept: str | None) -> bool:
    """Whether a client takes HTML: browsers name it, curl and the HTTP libraries send */*. A client
    that sends no Accept (Go's, as Ollama's tools are) or excludes HTML gets Ollama's answer instead."""
    if not accept:
        return False
    kinds = {part.split(";", 1)[0].strip().lower() for part in accept.split(",")}
    return bool(kinds & {"text/html", "text/*", "*/*", "application/xhtml+xml"})


@router.api_route("/", methods=["GET", "HEAD"], include_in_schema=False)
async def chat_page(request: Request) -> Response:
    """The chat page (docs/chat-page.md): one static file shipped in the package, read once; to a client
    that takes no HTML, what Ollama answers at its root (docs/decisions.md, "GET / and HEAD /")."""
    if request.method == "HEAD":  # Ollama's clients probe the server so; a 200 is all they read
        return Response(status_code=200)
    if _wants_page(request.headers.get("accept")):
        return HTMLResponse(_PAGE)
    return PlainTextResponse("Ollama is running")


@router.get("/health")
async def health(request: Request) -> Response:
    """Never loads a model: one model's server answers for its engine; a many-model server is up while it
    runs, and says each model's state (a model whose engine failed is unloaded, the others serve on)."""
    pool: ModelPool = request.app.state.models
    st = pool.single
    if st is None:
        return JSONResponse({"status": "ok", "learning": False,
                             "models": [{"model": e.name, "state": e.status,
                                         **({"last_error": e.last_error} if e.last_error else {})}
                                        for e in pool.entries.values()]})
    engine = st.engine
    if engine.failure is not None:
        return error_response(503, f"engine is not running: {engine.failure}", None, "engine_failed")
    if not engine.is_alive:
        return error_response(503, "engine is not running")
    replicas = engine.replicas
    body: dict[str, Any] = {"status": "ok", "learning": st.service.learner is not None}
    if len(replicas) > 1:  # data parallel: which replicas serve (a restarting one is not an outage)
        body["replicas"] = [{"replica": r.index, "status": r.status, "restarts": r.restarts,
                             **({"last_error": r.last_error} if r.last_error else {})} for r in replicas]
    return JSONResponse(body)


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    """Read from the registry at scrape time; loads no model (an unloaded one has no engine series)."""
    registry = request.app.state.metrics.registry
    return Response(generate_latest(registry), media_type="text/plain; version=0.0.4; charset=utf-8")
