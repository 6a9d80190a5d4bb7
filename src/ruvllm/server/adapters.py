"""Adapter admin (vLLM's routes): loading and unloading LoRA adapters at run time, and the operator's
policy of where adapters may be read from (docs/adapters.md)."""

from __future__ import annotations

import asyncio
import os
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
    check_operator(request, st.cfg)


def check_operator(request: Request, cfg: ServerConfig) -> None:
    """operator_only over the server's settings (the model admin routes: no model is loaded to ask)."""
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
    folder, files = _check_lora_path(st.cfg, body.lora_path)
    # The folder as checked (resolved), and what was checked of each file: the engine reads only a
    # descriptor that is that file (lora/checked_files.py), so nothing swapped in since is read.
    try:
        await asyncio.to_thread(st.engine.load_lora, body.lora_name, str(folder), files)
    except AdapterError as exc:  # told as the client gave the path, not as this host resolved it
        raise type(exc)(str(exc).replace(str(folder), body.lora_path)) from None
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


def _identities(folder: Path) -> dict[str, tuple[str, int, int]]:
    """Each folder and file that loading the adapter at `folder` reads (an X-LoRA model's sub-folders'
    and mixed adapters' too), as what it resolves to: (real path, device, inode; -1 where nothing is)."""
    from ruvllm.lora.xlora import xlora_expert_paths

    experts = xlora_expert_paths(folder)
    folders = [folder, *(folder / str(i) for i in range(len(experts))), *experts]
    found = {}
    for f in [*folders, *(d / name for d in folders for name in ("adapter_config.json", "adapter_model.safetensors"))]:
        if f in folders or os.path.lexists(f):
            real = os.path.realpath(f)
            st = os.stat(real) if os.path.exists(real) else None
            found[str(f)] = (real, st.st_dev, st.st_ino) if st else (real, -1, -1)
    return found


def _check_lora_path(cfg: ServerConfig, path: str) -> tuple[Path, dict[str, tuple[str, int, int]]]:
    """The folder resolved and the files the load reads (`_identities`); 403 unless the operator allowed
    adapters to be read from there: the folder and every file resolved, links followed, so neither
    `..` nor a symlinked folder or file can lead out."""
    folder = Path(path).expanduser().resolve()
    if cfg.allow_any_lora_path:
        return folder, _identities(folder)
    roots = [Path(p).expanduser().resolve() for p in (*cfg.startup_lora_paths, *cfg.lora_dirs)]
    startup = roots[:len(cfg.startup_lora_paths)]
    if not (folder in startup or any(folder.is_relative_to(d) for d in roots[len(startup):])):
        raise APIError(403, "this server does not load adapters from that path (the operator allows "
                            "--lora-dir folders and the paths given at start-up)", "lora_path", "path_not_allowed")
    # Every folder and file read, an X-LoRA model's mixed adapters' included, must resolve inside one.
    files = _identities(folder)
    if not all(any(Path(real).is_relative_to(root) for root in roots) for real, _, _ in files.values()):
        raise APIError(403, f"the adapter at {path} mixes an adapter from, or links to, a path this server does "
                            "not load adapters from", "lora_path", "path_not_allowed")
    return folder, files
