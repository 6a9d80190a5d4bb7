"""Hugging Face checkpoint folders: config.json plus safetensors weights (single file or sharded):
the config, the index and the weight files, without torch (hf_weights.py reads the tensors)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any


from ruvllm.config import SUPPORTED_ARCHITECTURES, ModelConfig
from ruvllm.errors import CorruptModelError, ModelLoadError, NotAModelError, UnsupportedArchitectureError
from ruvllm.loader.limits import check_config, flag, real_number, whole_number

CONFIG_FILE = "config.json"
SINGLE_WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
_REQUIRED = object()  # load_config: a key with no default

# Used only when config.json has no model_type (some hand-written configs).
_ARCHITECTURE_CLASSES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Gemma3ForCausalLM": "gemma3",
}
# config.json model_type -> our architecture name, where they differ
_MODEL_TYPES = {"gemma3_text": "gemma3"}


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
    if model_type is not None and not isinstance(model_type, str):
        raise CorruptModelError(f"{path}: model_type: must be a string, got {model_type!r}")
    if model_type == "gemma3":  # Gemma3ForConditionalGeneration: text plus a vision tower
        raise UnsupportedArchitectureError(
            f"{path}: model_type gemma3 is Gemma 3 with its vision tower, which ruvllm does not run; "
            "text-only Gemma 3 checkpoints (model_type gemma3_text, Gemma3ForCausalLM) are supported")
    model_type = _MODEL_TYPES.get(model_type, model_type)
    if model_type is None:
        classes = cfg.get("architectures")
        for cls in classes if isinstance(classes, list) else ():
            if isinstance(cls, str) and cls in _ARCHITECTURE_CLASSES:
                model_type = _ARCHITECTURE_CLASSES[cls]
                break
    if model_type not in SUPPORTED_ARCHITECTURES:
        shown = model_type if model_type is not None else f"unknown (architectures={cfg.get('architectures')})"
        raise UnsupportedArchitectureError(
            f"{path}: model_type {shown} is not supported (supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
        )
    return model_type


# ModelConfig field -> its name in config.json, for messages (see field_names).
FIELD_NAMES: Mapping[str, str] = MappingProxyType({
    "vocab_size": "vocab_size", "hidden_size": "hidden_size", "intermediate_size": "intermediate_size",
    "num_layers": "num_hidden_layers", "num_heads": "num_attention_heads", "num_kv_heads": "num_key_value_heads",
    "head_dim": "head_dim", "rms_norm_eps": "rms_norm_eps", "rope_theta": "rope_theta",
    "max_position_embeddings": "max_position_embeddings", "rope_scaling": "rope_scaling",
    "bos_token_id": "bos_token_id", "eos_token_ids": "eos_token_id", "rope_local_theta": "rope_local_base_freq",
})  # fmt: skip


def field_names(cfg: Mapping[str, Any]) -> dict[str, str]:
    """FIELD_NAMES, where a derived value is named by what it was derived from."""
    names = dict(FIELD_NAMES)
    if cfg.get("head_dim") is None:
        names["head_dim"] = "hidden_size / num_attention_heads"
    if cfg.get("num_key_value_heads") is None:
        names["num_kv_heads"] = "num_attention_heads"
    return names


def _rope(cfg: dict[str, Any], path: Path) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, rope_scaling) from either config style.

    transformers < 5 writes `rope_theta` + `rope_scaling`; transformers 5 writes a single
    `rope_parameters` dict holding rope_theta and rope_type ("default" meaning no scaling).
    """
    params = cfg.get("rope_parameters")
    scaling = cfg.get("rope_scaling")
    theta = cfg.get("rope_theta")
    if params is not None and not isinstance(params, dict):
        raise CorruptModelError(f"{path}: rope_parameters: expected an object, got {params!r}")
    if params:
        theta = params.get("rope_theta", theta)
        if scaling is None:
            scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    if scaling:
        if not isinstance(scaling, dict):
            raise CorruptModelError(f"{path}: rope_scaling: expected an object, got {scaling!r}")
        scaling = dict(scaling)
        # Old configs spell the kind "type"; keep one key so the rope code has a single place to look.
        if "type" in scaling:
            kind = scaling.pop("type")
            scaling.setdefault("rope_type", kind)
        if scaling.get("rope_type", "default") == "default":
            scaling = None
    return real_number(theta if theta is not None else 10000.0, path, "rope_theta"), scaling or None


def _eos_ids(value: Any, path: Path) -> tuple[int, ...]:
    if value is None:
        return ()
    values = value if isinstance(value, list) else [value]
    return tuple(whole_number(v, path, "eos_token_id") for v in values)


def load_config(folder: Path) -> ModelConfig:
    """config.json as a ModelConfig whose numbers are in range (loader/limits.py); every failure
    is one line naming config.json and the key."""
    path = folder / CONFIG_FILE
    cfg = read_config_json(folder)
    arch = _model_type(cfg, path)

    def number(key: str, default: Any = _REQUIRED) -> int:
        value = cfg.get(key, default)
        if value is _REQUIRED:
            raise CorruptModelError(f"{path}: {key}: missing (a required key)")
        return whole_number(value, path, key)

    def derived(key: str, otherwise: int) -> int:
        """None (or absent) means "derive it", as transformers reads these keys."""
        return otherwise if cfg.get(key) is None else whole_number(cfg[key], path, key)

    def boolean(key: str) -> bool:
        return flag(cfg.get(key, False), path, key)

    hidden = number("hidden_size")
    heads = number("num_attention_heads")
    if heads < 1:  # checked here, before head_dim is derived from it
        raise CorruptModelError(f"{path}: num_attention_heads: must be at least 1, got {heads}")
    rope_theta, rope_scaling = _rope(cfg, path)
    bos = cfg.get("bos_token_id")
    # Mistral's sliding_window (and Qwen's use_sliding_window) are ignored on purpose:
    # we attend over the full context, which matches them for prompts shorter than the window.
    gemma = _gemma3_fields(cfg, path, number("num_hidden_layers")) if arch == "gemma3" else {}
    if gemma:
        rope_theta, rope_scaling = gemma.pop("rope")
    config = ModelConfig(
        architecture=arch,
        vocab_size=number("vocab_size"),
        hidden_size=hidden,
        intermediate_size=number("intermediate_size"),
        num_layers=number("num_hidden_layers"),
        num_heads=heads,
        num_kv_heads=derived("num_key_value_heads", heads),
        head_dim=derived("head_dim", hidden // heads),
        rms_norm_eps=real_number(cfg.get("rms_norm_eps", 1e-6), path, "rms_norm_eps"),
        rope_theta=rope_theta,
        max_position_embeddings=number("max_position_embeddings", 2048),
        tie_word_embeddings=boolean("tie_word_embeddings"),
        # Qwen2 always has q/k/v biases and its config carries no flag for it.
        attention_bias=True if arch == "qwen2" else boolean("attention_bias"),
        qk_norm=arch in ("qwen3", "gemma3"),
        rope_scaling=rope_scaling,
        bos_token_id=None if bos is None else whole_number(bos, path, "bos_token_id"),
        eos_token_ids=_eos_ids(cfg.get("eos_token_id"), path),
        **gemma,
    )
    return check_config(config, path, field_names(cfg))


def _gemma3_fields(cfg: dict[str, Any], path: Path, num_layers: int) -> dict[str, Any]:
    """Gemma 3's own keys: which layers slide (`layer_types`, or the older every-Nth pattern), the
    window, each kind's RoPE (transformers 5: rope_parameters per layer type; 4: rope_theta,
    rope_local_base_freq, rope_scaling), the attention scalar and the final soft-cap."""
    activation = cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh"
    if activation != "gelu_pytorch_tanh":
        raise UnsupportedArchitectureError(f"{path}: hidden_activation {activation!r} (only gelu_pytorch_tanh is supported)")
    if flag(cfg.get("use_bidirectional_attention", False), path, "use_bidirectional_attention"):
        raise UnsupportedArchitectureError(f"{path}: use_bidirectional_attention: an encoder, not a causal LM")
    types = cfg.get("layer_types")
    if types is None:
        every = whole_number(cfg.get("sliding_window_pattern", cfg.get("_sliding_window_pattern", 6)), path,
                             "sliding_window_pattern")
        if every < 1:
            raise CorruptModelError(f"{path}: sliding_window_pattern: must be at least 1, got {every}")
        types = ["sliding_attention" if (i + 1) % every else "full_attention" for i in range(num_layers)]
    if not isinstance(types, list) or len(types) != num_layers or \
            any(t not in ("sliding_attention", "full_attention") for t in types):
        raise CorruptModelError(f"{path}: layer_types: expected {num_layers} of sliding_attention/full_attention")
    params = cfg.get("rope_parameters")
    if isinstance(params, dict) and "full_attention" in params:
        theta, scaling = _rope({"rope_parameters": params["full_attention"]}, path)
        local_theta, local_scaling = _rope({"rope_parameters": params.get("sliding_attention")}, path)
    else:
        theta, scaling = _rope(cfg, path)
        local_theta, local_scaling = real_number(cfg.get("rope_local_base_freq", 10000.0), path, "rope_local_base_freq"), None
    if local_scaling:
        raise UnsupportedArchitectureError(f"{path}: rope scaling on the sliding-window layers is not supported")
    window = cfg.get("sliding_window")
    cap = cfg.get("final_logit_softcapping")
    scalar = cfg.get("query_pre_attn_scalar")
    return dict(
        rope=(theta, scaling),
        sliding_layers=tuple(i for i, t in enumerate(types) if t == "sliding_attention"),
        sliding_window=None if window is None else whole_number(window, path, "sliding_window"),
        rope_local_theta=local_theta,
        query_pre_attn_scalar=None if scalar is None else real_number(scalar, path, "query_pre_attn_scalar"),
        final_logit_softcapping=None if cap is None else real_number(cap, path, "final_logit_softcapping"),
    )


def read_index(folder: Path) -> dict[str, Path]:
    """model.safetensors.index.json's weight_map: tensor name -> the shard file that holds it."""
    index = folder / INDEX_FILE
    try:
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
    except OSError as e:
        raise ModelLoadError(f"{index}: cannot read ({e.strerror or e})") from None
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as e:
        raise CorruptModelError(f"{index}: not a valid safetensors index ({e!r})") from None
    if not isinstance(weight_map, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()):
        raise CorruptModelError(f"{index}: weight_map: expected an object of tensor name -> file name")
    return {name: folder / file for name, file in weight_map.items()}


def shards(folder: Path) -> dict[Path, list[str] | None]:
    """Weight files to read, each with the tensor names it must hold (None: all it has)."""
    if (folder / INDEX_FILE).is_file():
        shards: dict[Path, list[str] | None] = {}
        for name, file in read_index(folder).items():
            shards.setdefault(file, []).append(name)  # type: ignore[union-attr]
        return shards
    single = folder / SINGLE_WEIGHTS_FILE
    if single.is_file():
        return {single: None}
    raise NotAModelError(f"{folder}: no {SINGLE_WEIGHTS_FILE} or {INDEX_FILE} (only safetensors weights are supported)")


def weight_files(folder: Path) -> list[Path]:
    """The safetensors files holding the weights, in the order they are read."""
    return list(shards(folder))
