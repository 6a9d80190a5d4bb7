"""Sane ranges for the numbers of a ModelConfig, checked as soon as a config is read.

Both loaders (config.json, GGUF metadata) call check_config before returning a config, so a
10^9-layer header fails here, in microseconds, instead of after the engine has started building
10^9 layers. Each upper bound is far beyond any released model of the families ruvllm runs; the
tensors present are what pins the real values (loader/checks.py). Messages name the field as the
file spells it (`num_attention_heads` in config.json, `llama.attention.head_count` in GGUF).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ruvllm.config import ModelConfig
from ruvllm.errors import CorruptModelError, UnsupportedArchitectureError

# ModelConfig field -> (smallest, largest) accepted value.
INT_RANGES: tuple[tuple[str, int, int], ...] = (
    ("vocab_size", 1, 1 << 22),  # 4M tokens; the largest vocabularies are ~260k
    ("hidden_size", 1, 1 << 16),
    ("intermediate_size", 1, 1 << 20),
    ("num_layers", 1, 1024),  # the deepest released models have ~130
    ("num_heads", 1, 1024),
    ("num_kv_heads", 1, 1024),
    ("head_dim", 2, 1024),
    # >= 2: a context of 0 or 1 token can hold no prompt plus a reply. 16M: beyond the longest
    # released context (10M), and the RoPE table alone would take gigabytes.
    ("max_position_embeddings", 2, 1 << 24),
)
ROPE_TYPES = ("linear", "llama3")  # what layers/rotary.py implements besides the default


def whole_number(value: Any, file: Path | str, name: str) -> int:
    """An integer header number. Strings ("576"), bools and floats (64.0) are refused, as
    transformers refuses them when the tokenizer is built: `info` and a load agree."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    raise CorruptModelError(f"{file}: {name}: must be an integer, got {value!r}")


def real_number(value: Any, file: Path | str, name: str) -> float:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    raise CorruptModelError(f"{file}: {name}: must be a number, got {value!r}")


def flag(value: Any, file: Path | str, name: str) -> bool:
    if isinstance(value, bool):
        return value
    raise CorruptModelError(f"{file}: {name}: must be true or false, got {value!r}")


def check_config(cfg: ModelConfig, file: Path | str, names: Mapping[str, str]) -> ModelConfig:
    """cfg, if every number is in range and consistent; else CorruptModelError naming the field
    (names: ModelConfig field -> the file's own name for it)."""

    def fail(field: str, problem: str) -> CorruptModelError:
        return CorruptModelError(f"{file}: {names.get(field, field)}: {problem}")

    for field, low, high in INT_RANGES:
        value = getattr(cfg, field)
        if value < low:
            raise fail(field, f"must be at least {low}, got {value}")
        if value > high:
            raise fail(field, f"{value} is beyond any real model (at most {high})")
    if cfg.num_kv_heads > cfg.num_heads or cfg.num_heads % cfg.num_kv_heads:
        raise fail("num_kv_heads", f"{cfg.num_kv_heads} does not divide {names.get('num_heads', 'num_heads')} "
                                   f"{cfg.num_heads} (each KV head serves a whole group of query heads)")
    if cfg.head_dim % 2:
        raise fail("head_dim", f"{cfg.head_dim} is odd (rotary embeddings rotate pairs of channels)")
    if not (math.isfinite(cfg.rms_norm_eps) and 0 < cfg.rms_norm_eps < 1):
        raise fail("rms_norm_eps", f"{cfg.rms_norm_eps} is not a small positive number")
    if not (math.isfinite(cfg.rope_theta) and cfg.rope_theta > 0):
        raise fail("rope_theta", f"{cfg.rope_theta} is not a positive number")
    _check_rope_scaling(cfg, file, names.get("rope_scaling", "rope_scaling"))
    for field in ("sliding_window", "query_pre_attn_scalar", "final_logit_softcapping", "rope_local_theta"):
        value = getattr(cfg, field)  # Gemma 3's: None where the family has none
        if value is not None and not (math.isfinite(value) and value > 0):
            raise fail(field, f"{value} is not a positive number")
    for field, ids in (("bos_token_id", () if cfg.bos_token_id is None else (cfg.bos_token_id,)),
                       ("eos_token_ids", cfg.eos_token_ids)):
        for token in ids:
            if isinstance(token, bool) or not isinstance(token, int) or token < 0:
                raise fail(field, f"{token!r} is not a token id")
    return cfg


def _check_rope_scaling(cfg: ModelConfig, file: Path | str, name: str) -> None:
    scaling = cfg.rope_scaling
    if scaling is None:
        return
    kind = scaling.get("rope_type")
    if kind not in ROPE_TYPES:
        raise UnsupportedArchitectureError(
            f"{file}: {name}: rope type {kind!r} is not supported (supported: default, {', '.join(ROPE_TYPES)})")
    # The RoPE code divides by these (and by high - low): a zero or missing one cannot be computed.
    factor = real_number(scaling.get("factor"), file, f"{name}.factor")
    if not (math.isfinite(factor) and factor > 0):
        raise CorruptModelError(f"{file}: {name}.factor: {factor} is not a positive number")
    if kind == "llama3":
        low = real_number(scaling.get("low_freq_factor", 1.0), file, f"{name}.low_freq_factor")
        high = real_number(scaling.get("high_freq_factor", 4.0), file, f"{name}.high_freq_factor")
        original = real_number(scaling.get("original_max_position_embeddings", 8192), file,
                               f"{name}.original_max_position_embeddings")
        if not (0 < low < high and math.isfinite(high)):
            raise CorruptModelError(f"{file}: {name}: low_freq_factor {low} must be positive and below "
                                    f"high_freq_factor {high}")
        if not (math.isfinite(original) and original > 0):
            raise CorruptModelError(f"{file}: {name}.original_max_position_embeddings: {original} is not positive")
