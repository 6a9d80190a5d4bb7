"""The served model as Ollama's listings describe it (/api/tags, /api/show, /api/ps): read once from
its files' headers (never the weights): the format, family, parameter count and quantization, the
architecture's numbers (`model_info`). The digest names the files as they are on disk (names, sizes,
modification times), not their bytes: hashing a 15 GB model on the first /api/tags would stall every
client that lists models at start."""

from __future__ import annotations

import asyncio
import hashlib
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from fastapi import Request

from ruvllm.messages import EngineInfo
from ruvllm.server.generation import ServerState


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
    return await card_named(request, st.cfg.served_model_name, lambda: read_card(st.engine.info))


async def card_named(request: Request, name: str, read: Any) -> ModelCard:
    app_state = request.app.state
    cards = getattr(app_state, "ollama_cards", None)
    if cards is None:
        cards = app_state.ollama_cards = {}
    if name not in cards:
        cards[name] = await asyncio.to_thread(read)
    return cards[name]


def file_card(config: Any) -> ModelCard:
    """A model not loaded (a many-model server): its card from its files' headers alone."""
    from ruvllm.loader import load_model_config, resolve_model as resolve_source

    src = resolve_source(config.model)
    mc = load_model_config(src)
    ctx = min(config.max_model_len or mc.max_position_embeddings, mc.max_position_embeddings)
    return _gguf_card(src.path, ctx) if src.format == "gguf" else _hf_card(src.path, ctx)
