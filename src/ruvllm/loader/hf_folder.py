"""Hugging Face checkpoint folders: config.json plus safetensors weights (single file or sharded)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from ruvllm.config import SUPPORTED_ARCHITECTURES, ModelConfig
from ruvllm.errors import CorruptModelError, NotAModelError, UnsupportedArchitectureError
from ruvllm.quant.checkpoints import assemble, checkpoint_quant
from ruvllm.quant.weights import QuantizedWeight

CONFIG_FILE = "config.json"
SINGLE_WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

# Used only when config.json has no model_type (some hand-written configs).
_ARCHITECTURE_CLASSES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}


def has_weights(folder: Path) -> bool:
    return (folder / SINGLE_WEIGHTS_FILE).is_file() or (folder / INDEX_FILE).is_file()


def read_config_json(folder: Path) -> dict[str, Any]:
    path = folder / CONFIG_FILE
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise NotAModelError(f"{path}: missing; a Hugging Face model folder needs config.json") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CorruptModelError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise CorruptModelError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def _model_type(cfg: dict[str, Any], path: Path) -> str:
    model_type = cfg.get("model_type")
    if model_type is None:
        for cls in cfg.get("architectures") or ():
            if cls in _ARCHITECTURE_CLASSES:
                model_type = _ARCHITECTURE_CLASSES[cls]
                break
    if model_type not in SUPPORTED_ARCHITECTURES:
        shown = model_type if model_type is not None else f"unknown (architectures={cfg.get('architectures')})"
        raise UnsupportedArchitectureError(
            f"{path}: model_type {shown} is not supported (supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
        )
    return model_type


def _rope(cfg: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, rope_scaling) from either config style.

    transformers < 5 writes `rope_theta` + `rope_scaling`; transformers 5 writes a single
    `rope_parameters` dict holding rope_theta and rope_type ("default" meaning no scaling).
    """
    params = cfg.get("rope_parameters")
    scaling = cfg.get("rope_scaling")
    theta = cfg.get("rope_theta")
    if isinstance(params, dict):
        theta = params.get("rope_theta", theta)
        if scaling is None:
            scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    if scaling:
        scaling = dict(scaling)
        # Old configs spell the kind "type"; keep one key so the rope code has a single place to look.
        if "type" in scaling:
            kind = scaling.pop("type")
            scaling.setdefault("rope_type", kind)
        if scaling.get("rope_type", "default") == "default":
            scaling = None
    return float(theta if theta is not None else 10000.0), scaling or None


def _eos_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def load_config(folder: Path) -> ModelConfig:
    path = folder / CONFIG_FILE
    cfg = read_config_json(folder)
    arch = _model_type(cfg, path)
    try:
        hidden = int(cfg["hidden_size"])
        heads = int(cfg["num_attention_heads"])
        rope_theta, rope_scaling = _rope(cfg)
        # Mistral's sliding_window (and Qwen's use_sliding_window) are ignored on purpose:
        # we attend over the full context, which matches them for prompts shorter than the window.
        return ModelConfig(
            architecture=arch,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or hidden // heads),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            # Qwen2 always has q/k/v biases and its config carries no flag for it.
            attention_bias=True if arch == "qwen2" else bool(cfg.get("attention_bias", False)),
            qk_norm=arch == "qwen3",
            rope_scaling=rope_scaling,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=_eos_ids(cfg.get("eos_token_id")),
        )
    except KeyError as e:
        raise CorruptModelError(f"{path}: missing required key {e.args[0]!r}") from None
    except (TypeError, ValueError, ZeroDivisionError) as e:
        raise CorruptModelError(f"{path}: bad value ({e})") from None


def _shards(folder: Path) -> dict[Path, list[str] | None]:
    """Weight files to read, each with the tensor names it must hold (None: all it has)."""
    index = folder / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as e:
            raise CorruptModelError(f"{index}: not a valid safetensors index ({e!r})") from None
        shards: dict[Path, list[str] | None] = {}
        for name, file in weight_map.items():
            shards.setdefault(folder / file, []).append(name)  # type: ignore[union-attr]
        return shards
    single = folder / SINGLE_WEIGHTS_FILE
    if single.is_file():
        return {single: None}
    raise NotAModelError(f"{folder}: no {SINGLE_WEIGHTS_FILE} or {INDEX_FILE} (only safetensors weights are supported)")


def iter_weights(folder: Path, dtype: torch.dtype,
                 keep_quantized: bool = False) -> Iterator[tuple[str, torch.Tensor | QuantizedWeight]]:
    """(Hugging Face name, tensor) one at a time, so peak memory stays near one tensor.

    config.json and the shard list are checked eagerly; tensor data is read lazily. GPTQ/AWQ
    checkpoints yield each quantized layer as `<layer>.weight`: a QuantizedWeight with
    keep_quantized, else its exact float values in dtype.
    """
    config = load_config(folder)
    scheme = checkpoint_quant(read_config_json(folder), str(folder / CONFIG_FILE))
    shards = _shards(folder)
    for file in shards:
        if not file.is_file():
            raise CorruptModelError(f"{file}: listed in {INDEX_FILE} but missing")
    raw_dtype = None if scheme is not None else dtype  # quantized parts keep their integer types
    stream = _generate(shards, config.tie_word_embeddings, raw_dtype)
    if scheme is None:
        return stream
    return _cast_dense(_drop_zero_biases(assemble(stream, scheme, str(folder), keep_quantized), config), dtype)


def _drop_zero_biases(stream: Iterator[tuple[str, Any]], config: ModelConfig) -> Iterator[tuple[str, Any]]:
    """GPTQ exporters write an all-zero bias for every layer; ours has biases only on q/k/v of
    models with attention_bias. A zero bias is a no-op, so those are dropped, not refused."""
    for name, tensor in stream:
        if name.endswith(".bias") and isinstance(tensor, torch.Tensor) and not tensor.any():
            qkv = name.endswith(("q_proj.bias", "k_proj.bias", "v_proj.bias"))
            if not (qkv and config.attention_bias):
                continue
        yield name, tensor


def _cast_dense(stream: Iterator[tuple[str, Any]], dtype: torch.dtype) -> Iterator[tuple[str, Any]]:
    for name, tensor in stream:
        yield name, tensor if isinstance(tensor, QuantizedWeight) else tensor.to(dtype)


def _generate(
    shards: dict[Path, list[str] | None], tied: bool, dtype: torch.dtype | None
) -> Iterator[tuple[str, torch.Tensor]]:
    for file, names in shards.items():
        try:
            with safe_open(str(file), framework="pt") as f:
                for name in names if names is not None else list(f.keys()):
                    # Tied checkpoints sometimes still store lm_head; callers use embed_tokens for it.
                    if (tied and name == "lm_head.weight") or name.endswith("rotary_emb.inv_freq"):
                        continue
                    tensor = f.get_tensor(name)
                    yield name, tensor if dtype is None else tensor.to(dtype)
        except SafetensorError as e:
            raise CorruptModelError(f"{file}: unreadable safetensors file ({e})") from None
