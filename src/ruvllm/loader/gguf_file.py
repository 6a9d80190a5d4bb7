"""GGUF files (llama.cpp format): metadata -> ModelConfig, tensors -> dequantized HF-named torch tensors."""

from __future__ import annotations

import functools
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType as QType
from gguf import GGUFReader, ReaderTensor
from gguf.quants import dequantize

from ruvllm.config import ModelConfig
from ruvllm.quant.gguf_blocks import KEPT_GGUF_TYPES, gguf_quantized
from ruvllm.quant.weights import QuantizedWeight
from ruvllm.errors import (
    CorruptModelError,
    ModelLoadError,
    UnsupportedArchitectureError,
    UnsupportedQuantizationError,
)

GGUF_MAGIC = b"GGUF"

# general.architecture values we read. Mistral and SmolLM2 GGUFs are written as "llama".
SUPPORTED_GGUF_ARCHITECTURES = ("llama", "qwen2", "qwen3")

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
ROPE_FREQS_TENSOR = "rope_freqs.weight"  # folded into ModelConfig.rope_scaling, not a weight
_LAYER_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


def hf_name(gguf_name: str) -> str | None:
    """Hugging Face name of a GGUF tensor, or None when it has no HF counterpart."""
    if gguf_name in _TOP_LEVEL_NAMES:
        return _TOP_LEVEL_NAMES[gguf_name]
    m = _LAYER_RE.fullmatch(gguf_name)
    if m and m.group(2) in _LAYER_PARTS:
        return f"model.layers.{m.group(1)}.{_LAYER_PARTS[m.group(2)]}.{m.group(3)}"
    return None


@functools.lru_cache(maxsize=1)
def _cached_reader(path: str, _mtime_ns: int, _size: int) -> GGUFReader:
    return GGUFReader(path)


def open_reader(path: Path) -> GGUFReader:
    """Parse a GGUF file, turning the reader's assorted exceptions into CorruptModelError.

    Parsing the 49k-entry vocabulary takes seconds, and config + weights both need the
    reader, so the last one is cached (keyed on mtime/size so a rewritten file is re-read).
    """
    try:
        with open(path, "rb") as f:
            magic = f.read(4)
        stat = path.stat()
    except OSError as e:
        raise ModelLoadError(f"{path}: cannot read ({e.strerror or e})") from None
    if magic != GGUF_MAGIC:
        raise CorruptModelError(f"{path}: not a GGUF file (magic {magic!r}, expected {GGUF_MAGIC!r})")
    try:
        reader = _cached_reader(str(path), stat.st_mtime_ns, stat.st_size)
    except Exception as e:  # GGUFReader raises ValueError/KeyError/IndexError... on short or garbled files
        raise CorruptModelError(f"{path}: truncated or corrupt GGUF file ({type(e).__name__}: {e})") from None
    # The reader memory-maps lazily, so a file cut inside the tensor data can still parse.
    for t in reader.tensors:
        if t.data_offset + t.n_bytes > stat.st_size:
            raise CorruptModelError(
                f"{path}: truncated GGUF file (tensor {t.name} ends at byte {t.data_offset + t.n_bytes}, "
                f"file has {stat.st_size})"
            )
    return reader


def _field(reader: GGUFReader, key: str, default: Any = None) -> Any:
    field = reader.get_field(key)
    return default if field is None else field.contents()


def _llama3_freq_divisors(theta: float, dim: int, factor: float, low: float, high: float, original: int) -> np.ndarray:
    """What llama.cpp stores in rope_freqs.weight for HF's "llama3" rope: the divisor of each
    inverse frequency (1 for short wavelengths, `factor` for long ones, a blend in between)."""
    inv_freq = 1.0 / theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
    wavelen = 2 * np.pi / inv_freq
    smooth = np.clip((original / wavelen - low) / (high - low), 0.0, 1.0)
    return 1.0 / ((1 - smooth) / factor + smooth)


def _rope_from_freq_tensor(reader: GGUFReader, arch: str, path: Path, t: ReaderTensor) -> dict[str, Any]:
    """Llama 3.x GGUFs carry rope scaling only as a per-frequency factor tensor. Every released
    Llama 3.x uses low_freq_factor=1, high_freq_factor=4 and an 8192 original context, so we
    rebuild HF's rope_scaling from those and accept it only if it reproduces the tensor (to 1e-4)."""
    divisors = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float64).reshape(-1)
    theta = float(_field(reader, f"{arch}.rope.freq_base", 10000.0))
    dim = 2 * divisors.size
    original = int(_field(reader, f"{arch}.rope.scaling.original_context_length", 8192))
    factor = float(divisors.max())
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


def _rope_scaling(reader: GGUFReader, arch: str, path: Path) -> dict[str, Any] | None:
    for t in reader.tensors:
        if t.name == ROPE_FREQS_TENSOR:
            return _rope_from_freq_tensor(reader, arch, path, t)
    kind = _field(reader, f"{arch}.rope.scaling.type")
    if kind in (None, "none"):
        return None
    scaling: dict[str, Any] = {"rope_type": kind}
    factor = _field(reader, f"{arch}.rope.scaling.factor")
    if factor is not None:
        scaling["factor"] = float(factor)
    original = _field(reader, f"{arch}.rope.scaling.original_context_length")
    if original is not None:
        scaling["original_max_position_embeddings"] = int(original)
    attn_factor = _field(reader, f"{arch}.rope.scaling.attn_factor")
    if attn_factor is not None:
        scaling["attention_factor"] = float(attn_factor)
    return scaling


def config_from_reader(reader: GGUFReader, path: Path) -> ModelConfig:
    arch = _field(reader, "general.architecture")
    if arch not in SUPPORTED_GGUF_ARCHITECTURES:
        raise UnsupportedArchitectureError(
            f"{path}: GGUF architecture {arch!r} is not supported "
            f"(supported: {', '.join(SUPPORTED_GGUF_ARCHITECTURES)})"
        )

    def need(key: str) -> Any:
        value = _field(reader, f"{arch}.{key}")
        if value is None:
            raise CorruptModelError(f"{path}: GGUF metadata lacks {arch}.{key}")
        return value

    hidden = int(need("embedding_length"))
    heads = int(need("attention.head_count"))
    names = {t.name for t in reader.tensors}
    vocab = _field(reader, f"{arch}.vocab_size")
    if vocab is None:
        tokens = reader.get_field("tokenizer.ggml.tokens")
        vocab = len(tokens.data) if tokens is not None else None
    if vocab is None:
        raise CorruptModelError(f"{path}: GGUF metadata gives no vocabulary size")
    # Instruct GGUFs may mark the chat end-of-turn token separately from eos; stop on both.
    eos = []
    for key in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id"):
        value = _field(reader, key)
        if value is not None and int(value) not in eos:
            eos.append(int(value))
    bos = _field(reader, "tokenizer.ggml.bos_token_id")
    return ModelConfig(
        architecture=arch,
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(need("feed_forward_length")),
        num_layers=int(need("block_count")),
        num_heads=heads,
        num_kv_heads=int(_field(reader, f"{arch}.attention.head_count_kv", heads)),
        head_dim=int(_field(reader, f"{arch}.attention.key_length", hidden // heads)),
        rms_norm_eps=float(need("attention.layer_norm_rms_epsilon")),
        rope_theta=float(_field(reader, f"{arch}.rope.freq_base", 10000.0)),
        max_position_embeddings=int(need("context_length")),
        tie_word_embeddings="output.weight" not in names,
        attention_bias="blk.0.attn_q.bias" in names,
        qk_norm=arch == "qwen3",
        rope_scaling=_rope_scaling(reader, arch, path),
        bos_token_id=int(bos) if bos is not None else None,
        eos_token_ids=tuple(eos),
    )


def load_config(path: Path) -> ModelConfig:
    return config_from_reader(open_reader(path), path)


def _unpermute_rope_rows(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row permutation for Llama-architecture GGUFs.

    HF Llama rotates the two halves of each head (rotate_half); llama.cpp rotates adjacent
    pairs, so its converter reorders each head's rows from [half0..., half1...] to
    interleaved [h0[0], h1[0], h0[1], h1[1], ...]. Reading rows as (head, pair, 2) and
    swapping the last two axes restores the halves. Works for weights (2-D) and biases (1-D).
    """
    out = w.shape[0]
    return w.reshape(n_heads, out // n_heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def _dequantize(t: ReaderTensor, path: Path) -> torch.Tensor:
    try:
        values = dequantize(t.data, t.tensor_type)
    except Exception as e:  # malformed block data
        raise CorruptModelError(f"{path}: cannot decode tensor {t.name} ({t.tensor_type.name}): {e}") from None
    # GGUF lists dims fastest-first (in_features, out_features); torch wants (out, in).
    shape = tuple(int(d) for d in reversed(t.shape.tolist()))
    values = values.astype(np.float32, copy=False).reshape(shape)
    if not values.flags.writeable:  # F32 data is a read-only view into the memory map: own a copy
        values = values.copy()
    return torch.from_numpy(values)


def _quantized(t: ReaderTensor, path: Path) -> QuantizedWeight:
    shape = (int(t.shape[1]), int(t.shape[0]))
    try:
        return gguf_quantized(t.data, t.tensor_type, shape)
    except ValueError as e:  # block data of the wrong size for the shape
        raise CorruptModelError(f"{path}: cannot decode tensor {t.name} ({t.tensor_type.name}): {e}") from None


def iter_weights(path: Path, dtype: torch.dtype,
                 keep_quantized: bool = False) -> Iterator[tuple[str, torch.Tensor | QuantizedWeight]]:
    """(Hugging Face name, tensor) for every tensor, dequantized and cast to dtype.

    With keep_quantized, 2-D tensors of the types with a packed kernel (Q4_0, Q4_1, Q4_K, Q8_0)
    come as QuantizedWeight instead, holding the file's own codes.

    The file is checked eagerly, so a bad file raises here rather than midway through loading.
    """
    reader = open_reader(path)
    config = config_from_reader(reader, path)
    for t in reader.tensors:
        if t.tensor_type not in SUPPORTED_TENSOR_TYPES:
            raise UnsupportedQuantizationError(
                f"{path}: tensor {t.name} uses quantization type {t.tensor_type.name}, which ruvllm "
                f"cannot read (supported: {', '.join(sorted(q.name for q in SUPPORTED_TENSOR_TYPES))})"
            )
        if hf_name(t.name) is None and t.name != ROPE_FREQS_TENSOR:
            raise UnsupportedArchitectureError(f"{path}: unexpected tensor {t.name} for a {config.architecture} model")
    return _generate(reader, config, path, dtype, keep_quantized)


def _generate(
    reader: GGUFReader, config: ModelConfig, path: Path, dtype: torch.dtype, keep_quantized: bool
) -> Iterator[tuple[str, torch.Tensor | QuantizedWeight]]:
    for t in reader.tensors:
        name = hf_name(t.name)
        if name is None:  # rope_freqs.weight, already folded into config.rope_scaling
            continue
        heads = None
        if config.architecture == "llama":
            if t.name.endswith((".attn_q.weight", ".attn_q.bias")):
                heads = config.num_heads
            elif t.name.endswith((".attn_k.weight", ".attn_k.bias")):
                heads = config.num_kv_heads
        if keep_quantized and t.tensor_type in KEPT_GGUF_TYPES and len(t.shape) == 2:
            qw = _quantized(t, path)
            yield name, qw if heads is None else qw.map_rows(lambda r, h=heads: _unpermute_rope_rows(r, h))
            continue
        tensor = _dequantize(t, path)
        if heads is not None:
            tensor = _unpermute_rope_rows(tensor, heads)
        yield name, tensor.to(dtype)
