"""Ollama's model routes: /api/tags, /api/show, /api/ps, /api/version and /api/pull.

What they say about the served model is read once from its files' headers (never the weights): the
format, family, parameter count and quantization, the architecture's numbers (`model_info`). The
digest names the files as they are on disk (names, sizes, modification times), not their bytes:
hashing a 15 GB model on the first /api/tags would stall every client that lists models at start.
LoRA adapters are listed beside the base model (a tenant sees only its own learned ones); the front
knows them by name only, so their entries carry no size, digest or date.

/api/pull downloads into the model cache through loader/hub.py, as `ruvllm download` does; what it
fetches is served by a server started on it (`ruvllm serve NAME`), not by this one.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import StreamingResponse
from starlette.routing import Match

from ruvllm import __version__
from ruvllm.errors import ModelLoadError
from ruvllm.loader.hub import TqdmBar
from ruvllm.messages import EngineInfo
from ruvllm.server.adapters import operator_only
from ruvllm.server.errors import OLLAMA, APIError, api_error
from ruvllm.server.generation import ServerState, state
from ruvllm.server.model_pool import ModelPool
from ruvllm.server.ollama_protocol import PullRequest, ShowRequest, resolve_model, served_name
from ruvllm.server.tenants import tenant_of
from ruvllm.tenants import may_use

router = APIRouter()

# /api/ps's expires_at for a model that is never unloaded (Ollama's own answer for keep_alive -1 is
# as far off): the served model stays loaded as long as the server runs.
NEVER = "9999-12-31T23:59:59Z"
PROGRESS_EVERY_S = 0.25  # a pull's progress lines, at most this often per file bar


def rfc3339(t: float) -> str:
    return datetime.fromtimestamp(t, timezone.utc).isoformat(timespec="microseconds").replace("+00:00", "Z")


@dataclass(frozen=True)
class ModelCard:
    """The served model as Ollama's listings describe it."""

    format: str  # "gguf" or "safetensors" ("" for a model built in memory)
    family: str
    parameters: int | None
    quantization_level: str  # the files' (Q4_K_M, BF16, ...); the engine may compute in another form
    size: int  # bytes on disk (in memory, for a model built there)
    modified_at: str
    digest: str
    license: str
    model_info: dict[str, Any]

    def details(self, parent: str = "") -> dict[str, Any]:
        return {"parent_model": parent, "format": self.format, "family": self.family, "families": [self.family],
                "parameter_size": _human_count(self.parameters), "quantization_level": self.quantization_level}


def _human_count(n: int | None) -> str:
    if n is None:
        return ""
    for scale, suffix in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= scale:
            return f"{n / scale:.2f}".rstrip("0").rstrip(".") + suffix
    return str(n)


def _identity(files: list[Path], base: Path) -> str:
    h = hashlib.sha256()
    for f in files:
        s = f.stat()
        h.update(f"{f.relative_to(base) if f != base else f.name}\0{s.st_size}\0{s.st_mtime_ns}\n".encode())
    return "sha256:" + h.hexdigest()


def read_card(info: EngineInfo) -> ModelCard:
    """From the files' headers; a model built in memory (tests, benchmarks) has only the engine's word."""
    from ruvllm.loader import resolve_model as resolve_source

    arch, ctx = info.architecture, info.max_seq_len
    path = Path(info.model)
    if not path.exists():
        level = _DTYPES.get(info.dtype, info.dtype.upper()) if info.quantization in ("", "none") else \
            info.quantization.upper()
        return ModelCard("", arch, None, level, info.weight_bytes, rfc3339(time.time()),
                         "sha256:" + hashlib.sha256(info.model.encode()).hexdigest(), "",
                         {"general.architecture": arch, f"{arch}.context_length": ctx})
    src = resolve_source(path)
    if src.format == "gguf":
        return _gguf_card(src.path, ctx)
    return _hf_card(src.path, ctx)


def _gguf_card(path: Path, ctx: int) -> ModelCard:
    import gguf

    from ruvllm.loader import gguf_file
    from ruvllm.loader.gguf_header import GGUFArray, read_header

    header = read_header(path)
    arch = str(header.get("general.architecture", ""))
    params = sum(t.n_elements for t in header.tensors if t.name != gguf_file.ROPE_FREQS_TENSOR)
    try:
        level = gguf.LlamaFileType(int(header.get("general.file_type"))).name.removeprefix("MOSTLY_")
    except (TypeError, ValueError):
        level = ""
    # Ollama's model_info is the GGUF metadata without the vocabulary; arrays are kept here as their
    # length only (gguf_header.py never reads them), so they are left out.
    info = {k: v for k, v in header.fields.items() if not k.startswith("tokenizer.") and not isinstance(v, GGUFArray)}
    info["general.parameter_count"] = params
    info[f"{arch}.context_length"] = ctx  # what a request can hold here (the model's own may be longer)
    st = path.stat()
    return ModelCard("gguf", arch, params, level, st.st_size, rfc3339(st.st_mtime), _identity([path], path),
                     str(header.get("general.license", "")), info)


# config.json's names for the numbers Ollama's model_info carries (GGUF's names, after the architecture)
_HF_INFO = {"embedding_length": "hidden_size", "block_count": "num_hidden_layers",
            "feed_forward_length": "intermediate_size", "attention.head_count": "num_attention_heads",
            "attention.head_count_kv": "num_key_value_heads", "vocab_size": "vocab_size",
            "rope.freq_base": "rope_theta", "attention.layer_norm_rms_epsilon": "rms_norm_eps"}
_DTYPES = {"bfloat16": "BF16", "float16": "F16", "float32": "F32"}


def _hf_card(folder: Path, ctx: int) -> ModelCard:
    from ruvllm.loader import hf_folder
    from ruvllm.loader.model_cache import folder_size
    from ruvllm.loader.safetensors_header import read_safetensors_header

    cfg = hf_folder.read_config_json(folder)
    arch = str(cfg.get("model_type") or "")
    tied = bool(cfg.get("tie_word_embeddings", False))
    weights = hf_folder.weight_files(folder)
    params = sum(e.n_elements for f in weights for name, e in read_safetensors_header(f).items()
                 if not (tied and name == "lm_head.weight") and not name.endswith("rotary_emb.inv_freq"))
    quant = cfg.get("quantization_config")
    dtype = str(cfg.get("dtype") or cfg.get("torch_dtype") or "")
    level = str(quant.get("quant_method", "")).upper() if isinstance(quant, dict) else _DTYPES.get(dtype, dtype.upper())
    info: dict[str, Any] = {"general.architecture": arch, "general.parameter_count": params,
                            f"{arch}.context_length": ctx}
    info.update({f"{arch}.{key}": cfg[name] for key, name in _HF_INFO.items() if cfg.get(name) is not None})
    files = sorted({*weights, folder / hf_folder.CONFIG_FILE})
    return ModelCard("safetensors", arch, params, level, folder_size(folder),
                     rfc3339(max(f.stat().st_mtime for f in files)), _identity(files, folder), "", info)


async def card(request: Request, st: ServerState) -> ModelCard:
    """Read once per model, on a worker thread (a GGUF header takes ~0.1 s), then kept with the app."""
    return await _card_named(request, st.cfg.served_model_name, lambda: read_card(st.engine.info))


async def _card_named(request: Request, name: str, read: Any) -> ModelCard:
    app_state = request.app.state
    cards = getattr(app_state, "ollama_cards", None)
    if cards is None:
        cards = app_state.ollama_cards = {}
    if name not in cards:
        cards[name] = await asyncio.to_thread(read)
    return cards[name]


def _file_card(config: Any) -> ModelCard:
    """A model not loaded (a many-model server): its card from its files' headers alone."""
    from ruvllm.loader import load_model_config, resolve_model as resolve_source

    src = resolve_source(config.model)
    mc = load_model_config(src)
    ctx = min(config.max_model_len or mc.max_position_embeddings, mc.max_position_embeddings)
    return _gguf_card(src.path, ctx) if src.format == "gguf" else _hf_card(src.path, ctx)


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
            c = await (card(request, st) if st is not None else _card_named(request, e.name,
                                                                              lambda e=e: _file_card(e.config)))
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


# ------------------------------------------------------------------ pull


class _PullProgress:
    """A loader.hub ProgressHook that turns huggingface_hub's byte bars into Ollama's progress lines,
    handed from the download's thread to the event loop (`emit`)."""

    def __init__(self, emit: Any) -> None:
        self.emit = emit

    def __call__(self, repo_id: str) -> Any:
        @contextmanager
        def bars() -> Iterator[type]:
            yield _bar_class(repo_id, self.emit)

        return bars()


def _bar_class(repo_id: str, emit: Any) -> type:
    class _Bar(TqdmBar):
        """Only byte bars report (the count of files says nothing Ollama's lines can carry), and the
        one repeating received bytes is quiet."""

        def started(self) -> None:
            self._sent = 0.0

        def advanced(self, n: float) -> None:
            now = time.monotonic()
            done = self.total is not None and self.n >= self.total
            if self.unit != "B" or self.repeats_bytes or (now - self._sent < PROGRESS_EVERY_S and not done):
                return
            self._sent = now
            line = {"status": f"pulling {repo_id}", "completed": int(self.n)}
            if self.total:
                line["total"] = int(self.total)
            emit(line)

    return _Bar


def _pull_error(exc: BaseException) -> APIError:
    """A failed pull as its status: a name that is no model here or on the Hub is the request's
    fault; a Hub that cannot be reached is not (502)."""
    from huggingface_hub.errors import (EntryNotFoundError, GatedRepoError, RepositoryNotFoundError,
                                        RevisionNotFoundError)

    from ruvllm.loader.hub import HubError

    if isinstance(exc, ValueError):
        return APIError(400, str(exc), "model")
    if isinstance(exc, HubError):
        # hub.py raises its one-line HubError `from None` inside the handler of huggingface_hub's
        # error, which stays its __context__: what the Hub said
        cause = exc.__context__
        if isinstance(cause, (RepositoryNotFoundError, RevisionNotFoundError, EntryNotFoundError)):
            return APIError(404, f"pull model manifest: {exc}", "model", "model_not_found")
        if isinstance(cause, GatedRepoError):
            return APIError(403, str(exc), "model")
        if cause is None:  # the repository is there but holds nothing ruvllm reads
            return APIError(400, str(exc), "model")
        return APIError(502, str(exc))
    if isinstance(exc, ModelLoadError):
        return APIError(400, str(exc), "model")
    return api_error(exc)


def _pull_lock(request: Request) -> asyncio.Lock:
    """One pull at a time per server: two of one model would share its download folder."""
    lock = getattr(request.app.state, "ollama_pull_lock", None)
    if lock is None:
        lock = request.app.state.ollama_pull_lock = asyncio.Lock()
    return lock


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
        raise _pull_error(exc) from None

    loop = asyncio.get_running_loop()
    lines: asyncio.Queue[dict[str, Any] | BaseException | None] = asyncio.Queue()  # None: done
    progress = _PullProgress(lambda line: loop.call_soon_threadsafe(lines.put_nowait, line))

    async def download() -> None:
        async with _pull_lock(request):
            try:
                # a variant that must be converted (int4 of a safetensors model) needs the CLI's
                # converter, which runs for minutes: refused here (ValueError) rather than run in the server
                await asyncio.to_thread(hub.download, name, progress=progress)
            except BaseException as exc:  # told to the reader; the download thread has ended
                lines.put_nowait(exc)
                return
        lines.put_nowait(None)

    task = asyncio.create_task(download())  # runs to its end even if the client leaves: a half-pull resumes anyway
    first = await lines.get()  # a failure before any file arrives still gets its status line
    if isinstance(first, BaseException):
        raise _pull_error(first)
    if not body.stream:
        while first is not None:
            if isinstance(first, BaseException):
                raise _pull_error(first)
            first = await lines.get()
        await task
        return {"status": "success"}

    async def stream() -> AsyncIterator[str]:
        item: dict[str, Any] | BaseException | None = first
        yield _line({"status": "pulling manifest"})
        while item is not None:
            if isinstance(item, BaseException):
                err = _pull_error(item)
                yield _line(OLLAMA.body(err.status, err.message, err.param, err.code))
                return
            yield _line(item)
            item = await lines.get()
        yield _line({"status": "success"})

    return StreamingResponse(stream(), media_type=OLLAMA.stream_media_type)
