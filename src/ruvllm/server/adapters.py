"""Adapter admin (vLLM's routes): loading and unloading LoRA adapters at run time, and the operator's
policy of where adapters may be read from (docs/adapters.md)."""

from __future__ import annotations

import asyncio
from pathlib import Path

from fastapi import APIRouter, Depends, Request
from fastapi.responses import PlainTextResponse, Response

from ruvllm.errors import AdapterError, AdapterNotFoundError
from ruvllm.server.config import ServerConfig
from ruvllm.server.errors import APIError
from ruvllm.server.generation import ServerState, state
from ruvllm.server.protocol import LoadLoraRequest, UnloadLoraRequest
from ruvllm.tenants import LEARNED_PREFIX

def operator_only(request: Request, st: ServerState = Depends(state)) -> None:
    """What changes the server for everyone is the operator's: with keys, only the admin key
    (--admin-key, else --api-key) may; a server with tenants' keys and no admin key refuses all."""
    cfg = st.cfg
    if getattr(request.state, "admin", False) or not (cfg.admin_key or cfg.api_key or cfg.api_keys):
        return
    why = ": it needs the admin key" if cfg.admin_key or cfg.api_key else \
        ", and this server has no admin key (start it with --admin-key)"
    raise APIError(403, f"this route is the operator's{why}", None, "admin_only")


def _not_reserved(name: str) -> None:
    if name.startswith(LEARNED_PREFIX):
        raise APIError(403, f"adapter names starting with {LEARNED_PREFIX!r} are reserved for learned adapters, "
                            "which only the server loads and unloads", "lora_name", "reserved_name")


router = APIRouter(dependencies=[Depends(operator_only)])


@router.post("/v1/load_lora_adapter")
async def load_lora_adapter(body: LoadLoraRequest, st: ServerState = Depends(state)) -> Response:
    _not_reserved(body.lora_name)
    if not st.engine.info.max_loras:
        raise APIError(400, "LoRA adapters are not enabled on this server (start it with --enable-lora or "
                            "--lora NAME=PATH)", None, "lora_disabled")
    if body.lora_name == st.cfg.served_model_name or body.lora_name in st.engine.loras:
        raise APIError(400, f"the name {body.lora_name!r} is already in use", "lora_name", "name_in_use")
    _check_lora_path(st.cfg, body.lora_path)
    try:
        await asyncio.to_thread(st.engine.load_lora, body.lora_name, body.lora_path)
    except AdapterError as exc:  # told as the client gave the path, not as this host resolved it
        raise AdapterError(_without_host_paths(str(exc), body.lora_path)) from None
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")


@router.post("/v1/unload_lora_adapter")
async def unload_lora_adapter(body: UnloadLoraRequest, st: ServerState = Depends(state)) -> Response:
    _not_reserved(body.lora_name)
    if body.lora_name not in st.engine.loras:
        raise AdapterNotFoundError(f"no adapter named {body.lora_name!r} is loaded", "lora_name")
    try:
        await asyncio.to_thread(st.engine.unload_lora, body.lora_name)
    except AdapterError as exc:  # unloaded by another call meanwhile
        raise AdapterNotFoundError(str(exc), "lora_name") from None
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")


def _check_lora_path(cfg: ServerConfig, path: str) -> None:
    """403 unless the operator allowed adapters to be read from there (the folder resolved, links
    followed, so `..` and symlinks cannot lead out)."""
    if cfg.allow_any_lora_path:
        return

    def allowed(target: Path) -> bool:
        return any(target == Path(p).expanduser().resolve() for p in cfg.startup_lora_paths) or any(
            target.is_relative_to(Path(d).expanduser().resolve()) for d in cfg.lora_dirs)

    folder = Path(path).expanduser().resolve()
    if not allowed(folder):
        raise APIError(403, "this server does not load adapters from that path (the operator allows "
                            "--lora-dir folders and the paths given at start-up)", "lora_path", "path_not_allowed")
    # An X-LoRA checkpoint names the adapters it mixes: each of those must be allowed too (a load
    # that fails to read them reports that itself).
    from ruvllm.lora.xlora import xlora_expert_paths

    for expert in xlora_expert_paths(folder):
        if not (expert.resolve().is_relative_to(folder) or allowed(expert.resolve())):
            raise APIError(403, f"the X-LoRA model at {path} mixes an adapter from a path this server does not "
                                "load adapters from", "lora_path", "path_not_allowed")


def _without_host_paths(message: str, given: str) -> str:
    """An adapter error as the client may see it: the resolved host path replaced by the one given."""
    resolved = str(Path(given).expanduser())
    return message.replace(resolved, given) if resolved != given else message
