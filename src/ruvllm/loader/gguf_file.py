"""GGUF files (llama.cpp format): metadata -> ModelConfig, tensor names -> Hugging Face names, the
file's checks. No torch: the API front reads configs through here (gguf_weights.py reads the tensors)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType as QType
from gguf.quants import dequantize, quant_shape_to_byte_shape

from ruvllm.config import ModelConfig
from ruvllm.loader.gguf_header import GGUFArray, GGUFHeader, GGUFTensorInfo, read_header
from ruvllm.loader.limits import check_config, real_number, whole_number
from ruvllm.errors import (
    CorruptModelError,
    UnsupportedArchitectureError,
    UnsupportedQuantizationError,
)

# general.architecture values we read. Mistral and SmolLM2 GGUFs are written as "llama".
SUPPORTED_GGUF_ARCHITECTURES = ("llama", "qwen2", "qwen3", "gemma3")
# Gemma 3's layer pattern and local RoPE base are in no GGUF key: llama.cpp and transformers both
# hard-code them (every 6th layer global; base 10000 for the sliding layers).
GEMMA3_GLOBAL_EVERY = 6
GEMMA3_LOCAL_ROPE_THETA = 10000.0

# Types we dequantize. gguf's numpy code knows a few more (IQ*, TQ*, MXFP4), but those are
# slow in numpy and untested here, so we refuse them rather than load them half-trusted.
SUPPORTED_TENSOR_TYPES = frozenset(
    {
        QType.F32, QType.F16, QType.BF16,
        QType.Q4_0, QType.Q4_1, QType.Q5_0, QType.Q5_1, QType.Q8_0,
        QType.Q2_K, QType.Q3_K, QType.Q4_K, QType.Q5_K, QType.Q6_K,
    }
)  # fmt: skip

_TOP_LEVEL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_PARTS = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
# Gemma 3 has four norms a layer; its "ffn_norm" is the norm before the MLP, not Llama's post-attention.
_GEMMA3_LAYER_PARTS = {
    **_LAYER_PARTS,
    "ffn_norm": "pre_feedforward_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
ROPE_FREQS_TENSOR = "rope_freqs.weight"  # folded into ModelConfig.rope_scaling, not a weight
_LAYER_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


def _layer_parts(arch: str | None) -> dict[str, str]:
    return _GEMMA3_LAYER_PARTS if arch == "gemma3" else _LAYER_PARTS


def hf_name(gguf_name: str, arch: str | None = None) -> str | None:
    """Hugging Face name of a GGUF tensor of an `arch` model, or None when it has no HF counterpart."""
    if gguf_name in _TOP_LEVEL_NAMES:
        return _TOP_LEVEL_NAMES[gguf_name]
    m = _LAYER_RE.fullmatch(gguf_name)
    parts = _layer_parts(arch)
    if m and m.group(2) in parts:
        return f"model.layers.{m.group(1)}.{parts[m.group(2)]}.{m.group(3)}"
    return None


def gguf_name(hf: str, arch: str | None = None) -> str | None:
    """The GGUF name of a Hugging Face tensor name (the inverse of hf_name), for messages."""
    for gguf, name in _TOP_LEVEL_NAMES.items():
        if name == hf:
            return gguf
    m = re.fullmatch(r"model\.layers\.(\d+)\.(.+)\.(weight|bias)", hf)
    for part, name in _layer_parts(arch).items():
        if m and m.group(2) == name:
            return f"blk.{m.group(1)}.{part}.{m.group(3)}"
    return None


def tensor_bytes(data: np.ndarray, t: GGUFTensorInfo) -> np.ndarray:
    """One tensor's bytes from the file's memory map `data`, shaped [rows, bytes per row] (uint8, torch
    order) as gguf's quants take them. read_header checked that they lie inside the file."""
    # A plain ndarray view: numpy's memmap subclass costs a Python call per slice gguf's code takes.
    return np.asarray(data[t.offset:t.offset + t.n_bytes]).reshape(quant_shape_to_byte_shape(t.shape, t.tensor_type))


def map_file(header: GGUFHeader) -> np.ndarray:
    """The whole file, memory-mapped read-only: tensor data is paged in as each tensor is decoded.
    (gguf's GGUFReader would also parse every metadata entry into numpy objects: ~5 s for the
    default model's vocabulary, which loading never reads.)"""
    return np.memmap(header.path, dtype=np.uint8, mode="r")


def _llama3_freq_divisors(theta: float, dim: int, factor: float, low: float, high: float, original: int) -> np.ndarray:
    """What llama.cpp stores in rope_freqs.weight for HF's "llama3" rope: the divisor of each
    inverse frequency (1 for short wavelengths, `factor` for long ones, a blend in between)."""
    inv_freq = 1.0 / theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
    wavelen = 2 * np.pi / inv_freq
    smooth = np.clip((original / wavelen - low) / (high - low), 0.0, 1.0)
    return 1.0 / ((1 - smooth) / factor + smooth)


def decode(header: GGUFHeader, data: np.ndarray, t: GGUFTensorInfo) -> np.ndarray:
    """A tensor's values in float32, shaped as torch holds it (a view into the map for F32 files)."""
    raw = tensor_bytes(data, t)
    floats = {QType.F32: "f4", QType.F16: "f2"}
    try:
        if t.tensor_type in floats:  # in the file's byte order, which dequantize() would not know
            values = raw.view(header.byte_order + floats[t.tensor_type])
        else:
            values = dequantize(raw, t.tensor_type)
    except Exception as e:  # malformed block data
        raise CorruptModelError(f"{header.path}: cannot decode tensor {t.name} ({t.tensor_type.name}): {e}") from None
    return values.astype(np.float32, copy=False).reshape(t.shape)


def _tensor_values(header: GGUFHeader, t: GGUFTensorInfo) -> np.ndarray:
    """One (small) tensor's values, flat, in float64."""
    return decode(header, map_file(header), t).reshape(-1).astype(np.float64)


def _rope_from_freq_tensor(header: GGUFHeader, arch: str, t: GGUFTensorInfo) -> dict[str, Any]:
    """Llama 3.x GGUFs carry rope scaling only as a per-frequency factor tensor. Every released
    Llama 3.x uses low_freq_factor=1, high_freq_factor=4 and an 8192 original context, so we
    rebuild HF's rope_scaling from those and accept it only if it reproduces the tensor (to 1e-4)."""
    path = header.path
    if t.n_elements > 1024:  # one factor per pair of channels: head sizes are far below 2048
        raise CorruptModelError(f"{path}: {ROPE_FREQS_TENSOR}: {t.n_elements} values, more than any head size needs")
    divisors = _tensor_values(header, t)
    theta = real_number(header.get(f"{arch}.rope.freq_base", 10000.0), path, f"{arch}.rope.freq_base")
    dim = 2 * divisors.size
    key = f"{arch}.rope.scaling.original_context_length"
    original = whole_number(header.get(key, 8192), path, key)
    factor = float(divisors.max())
    if not (np.isfinite(divisors).all() and divisors.min() > 0 and theta > 0 and original > 0):
        raise CorruptModelError(f"{path}: {ROPE_FREQS_TENSOR}: holds values that are not positive factors")
    expected = _llama3_freq_divisors(theta, dim, factor, 1.0, 4.0, original)
    if not np.allclose(divisors, expected, rtol=1e-4):
        raise UnsupportedArchitectureError(
            f"{path}: rope_freqs.weight does not match Llama 3 rope scaling; per-frequency RoPE factors "
            "of this kind are not supported"
        )
    return {
        "rope_type": "llama3",
        "factor": factor,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": original,
    }


def _rope_scaling(header: GGUFHeader, arch: str) -> dict[str, Any] | None:
    path = header.path
    for t in header.tensors:
        if t.name == ROPE_FREQS_TENSOR:
            return _rope_from_freq_tensor(header, arch, t)
    kind = header.get(f"{arch}.rope.scaling.type")
    if kind in (None, "none"):
        return None
    scaling: dict[str, Any] = {"rope_type": kind}
    for key, hf_key, read in (("factor", "factor", real_number),
                              ("original_context_length", "original_max_position_embeddings", whole_number),
                              ("attn_factor", "attention_factor", real_number)):
        value = header.get(f"{arch}.rope.scaling.{key}")
        if value is not None:
            scaling[hf_key] = read(value, path, f"{arch}.rope.scaling.{key}")
    return scaling


def field_names(header: GGUFHeader) -> dict[str, str]:
    """ModelConfig field -> the GGUF key it came from (or, when derived, what from), for messages."""
    arch = header.get("general.architecture")
    _, vocab_key = vocab_source(header)
    head_dim = f"{arch}.attention.key_length"
    if header.get(head_dim) is None:
        head_dim = f"{arch}.embedding_length / {arch}.attention.head_count"
    kv_heads = f"{arch}.attention.head_count_kv"
    if header.get(kv_heads) is None:
        kv_heads = f"{arch}.attention.head_count"
    return {
        "vocab_size": vocab_key, "hidden_size": f"{arch}.embedding_length",
        "intermediate_size": f"{arch}.feed_forward_length", "num_layers": f"{arch}.block_count",
        "num_heads": f"{arch}.attention.head_count", "num_kv_heads": kv_heads,
        "head_dim": head_dim, "rms_norm_eps": f"{arch}.attention.layer_norm_rms_epsilon",
        "rope_theta": f"{arch}.rope.freq_base", "max_position_embeddings": f"{arch}.context_length",
        "rope_scaling": f"{arch}.rope.scaling", "bos_token_id": "tokenizer.ggml.bos_token_id",
        "eos_token_ids": "tokenizer.ggml.eos_token_id", "sliding_window": f"{arch}.attention.sliding_window",
        "final_logit_softcapping": f"{arch}.final_logit_softcapping",
    }  # fmt: skip


def vocab_source(header: GGUFHeader) -> tuple[int | None, str]:
    """(vocabulary size, the key it comes from): {arch}.vocab_size, else the token list's length."""
    arch = header.get("general.architecture")
    key = f"{arch}.vocab_size"
    if header.get(key) is not None:
        return whole_number(header.get(key), header.path, key), key
    tokens = header.get("tokenizer.ggml.tokens")
    if isinstance(tokens, GGUFArray):
        return tokens.count, "tokenizer.ggml.tokens (its length)"
    return None, key


def config_from_header(header: GGUFHeader) -> ModelConfig:
    """GGUF metadata as a ModelConfig whose numbers are in range (loader/limits.py); every failure
    is one line naming the file and the key."""
    path = header.path
    arch = header.get("general.architecture")
    if arch not in SUPPORTED_GGUF_ARCHITECTURES:
        raise UnsupportedArchitectureError(
            f"{path}: GGUF architecture {arch!r} is not supported "
            f"(supported: {', '.join(SUPPORTED_GGUF_ARCHITECTURES)})"
        )

    def number(key: str, default: Any = None, read: Any = whole_number) -> Any:
        value = header.get(f"{arch}.{key}", default)
        if value is None:
            raise CorruptModelError(f"{path}: {arch}.{key}: missing from the GGUF metadata")
        return read(value, path, f"{arch}.{key}")

    hidden = number("embedding_length")
    heads = number("attention.head_count")
    if heads < 1:  # checked here, before key_length's default is derived from it
        raise CorruptModelError(f"{path}: {arch}.attention.head_count: must be at least 1, got {heads}")
    head_dim = number("attention.key_length", hidden // heads)
    value_dim = number("attention.value_length", head_dim)
    if value_dim != head_dim:
        raise UnsupportedArchitectureError(f"{path}: {arch}.attention.value_length: {value_dim} differs from "
                                           f"key_length {head_dim} (not supported)")
    vocab, vocab_key = vocab_source(header)
    if vocab is None:
        raise CorruptModelError(f"{path}: {vocab_key}: missing, and no tokenizer.ggml.tokens to count")
    names = {t.name for t in header.tensors}
    # Instruct GGUFs may mark the chat end-of-turn token separately from eos; stop on both.
    eos: list[int] = []
    for key in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id"):
        value = header.get(key)
        token = None if value is None else whole_number(value, path, key)
        if token is not None and token not in eos:
            eos.append(token)
    bos = header.get("tokenizer.ggml.bos_token_id")
    num_layers = number("block_count")
    gemma: dict[str, Any] = {}
    if arch == "gemma3":
        cap = header.get(f"{arch}.final_logit_softcapping")
        gemma = dict(
            sliding_layers=tuple(i for i in range(num_layers) if (i + 1) % GEMMA3_GLOBAL_EVERY),
            sliding_window=number("attention.sliding_window"),
            rope_local_theta=GEMMA3_LOCAL_ROPE_THETA,
            # llama.cpp: 1/sqrt(hidden / heads) for the 27B model (62 layers), else 1/sqrt(key_length)
            query_pre_attn_scalar=float(hidden // heads if num_layers == 62 else head_dim),
            final_logit_softcapping=None if cap is None else real_number(cap, path, f"{arch}.final_logit_softcapping"),
        )
    config = ModelConfig(
        architecture=arch,
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=number("feed_forward_length"),
        num_layers=num_layers,
        num_heads=heads,
        num_kv_heads=number("attention.head_count_kv", heads),
        head_dim=head_dim,
        rms_norm_eps=number("attention.layer_norm_rms_epsilon", read=real_number),
        rope_theta=number("rope.freq_base", 10000.0, real_number),
        max_position_embeddings=number("context_length"),
        tie_word_embeddings="output.weight" not in names,
        attention_bias="blk.0.attn_q.bias" in names,
        qk_norm=arch in ("qwen3", "gemma3"),
        rope_scaling=_rope_scaling(header, arch),
        bos_token_id=None if bos is None else whole_number(bos, path, "tokenizer.ggml.bos_token_id"),
        eos_token_ids=tuple(eos),
        **gemma,
    )
    return check_config(config, path, field_names(header))


def load_config(path: Path) -> ModelConfig:
    return config_from_header(read_header(path))


def check_tensor_kinds(header: GGUFHeader, arch: str) -> None:
    """Every tensor is one we can read (its type) and place (its name)."""
    for t in header.tensors:
        if t.tensor_type not in SUPPORTED_TENSOR_TYPES:
            raise UnsupportedQuantizationError(
                f"{header.path}: tensor {t.name} uses quantization type {t.tensor_type.name}, which ruvllm "
                f"cannot read (supported: {', '.join(sorted(q.name for q in SUPPORTED_TENSOR_TYPES))})"
            )
        if hf_name(t.name, arch) is None and t.name != ROPE_FREQS_TENSOR:
            raise UnsupportedArchitectureError(f"{header.path}: {t.name}: unexpected tensor for a {arch} model")
