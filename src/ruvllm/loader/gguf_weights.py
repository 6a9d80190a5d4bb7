"""A GGUF file's tensors as Hugging Face-named torch tensors (dequantized and cast), or kept in their
packed form for our kernels (gguf_file.py reads the metadata and names, without torch)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from ruvllm.config import ModelConfig
from ruvllm.errors import CorruptModelError
from ruvllm.loader.gguf_file import check_tensor_kinds, config_from_header, decode, hf_name, map_file, tensor_bytes
from ruvllm.loader.gguf_header import GGUFHeader, GGUFTensorInfo, read_header
from ruvllm.quant.gguf_blocks import (
    BLOCK_BYTES,
    KEPT_GGUF_TYPES,
    REQUANTIZED_GGUF_TYPES,
    gguf_dense,
    gguf_quantized,
    int8_groups,
)
from ruvllm.quant.weights import QuantizedWeight


def _unpermute_rope_rows(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row permutation for Llama-architecture GGUFs.

    HF Llama rotates the two halves of each head (rotate_half); llama.cpp rotates adjacent
    pairs, so its converter reorders each head's rows from [half0..., half1...] to
    interleaved [h0[0], h1[0], h0[1], h1[1], ...]. Reading rows as (head, pair, 2) and
    swapping the last two axes restores the halves. Works for weights (2-D) and biases (1-D).
    """
    out = w.shape[0]
    return w.reshape(n_heads, out // n_heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def _dequantize(header: GGUFHeader, data: np.ndarray, t: GGUFTensorInfo) -> torch.Tensor:
    if t.tensor_type in BLOCK_BYTES:  # (gguf's decoder gives the same values at half the speed)
        return gguf_dense(tensor_bytes(data, t), t.tensor_type, t.shape)
    values = decode(header, data, t)
    if not values.flags.writeable:  # a view into the read-only map: own a copy
        values = values.astype(np.float32)
    return torch.from_numpy(values)


def _quantized(header: GGUFHeader, data: np.ndarray, t: GGUFTensorInfo) -> QuantizedWeight:
    try:
        return gguf_quantized(tensor_bytes(data, t), t.tensor_type, t.shape)
    except ValueError as e:  # block data of the wrong size for the shape
        raise CorruptModelError(f"{header.path}: cannot decode tensor {t.name} ({t.tensor_type.name}): {e}") from None


def iter_weights(path: Path, dtype: torch.dtype,
                 keep_quantized: bool = False) -> Iterator[tuple[str, torch.Tensor | QuantizedWeight]]:
    """(Hugging Face name, tensor) for every tensor, dequantized and cast to dtype.

    With keep_quantized, 2-D tensors of the types with a packed kernel (Q4_0, Q4_1, Q4_K, Q8_0)
    come as QuantizedWeight instead, holding the file's own codes, and those of the other quantized
    types (Q5_0, Q6_K, ...) requantized to int8 groups of 32 (gguf_blocks.REQUANTIZED_GGUF_TYPES).

    The file is checked eagerly, so a bad file raises here rather than midway through loading.
    """
    header = read_header(path)
    config = config_from_header(header)
    check_tensor_kinds(header, config.architecture)
    return _generate(header, config, dtype, keep_quantized)


def requantized(t: GGUFTensorInfo) -> bool:
    """Whether a tensor is read as int8 groups of 32 (with keep_quantized): a quantized matrix of a
    type without a kernel of ours, whose rows split into groups of 32."""
    return t.tensor_type in REQUANTIZED_GGUF_TYPES and len(t.shape) == 2 and t.shape[1] % 32 == 0


def _generate(
    header: GGUFHeader, config: ModelConfig, dtype: torch.dtype, keep_quantized: bool
) -> Iterator[tuple[str, torch.Tensor | QuantizedWeight]]:
    data = map_file(header)
    for t in header.tensors:
        name = hf_name(t.name, config.architecture)
        if name is None:  # rope_freqs.weight, already folded into config.rope_scaling
            continue
        heads = None
        if config.architecture == "llama":
            if t.name.endswith((".attn_q.weight", ".attn_q.bias")):
                heads = config.num_heads
            elif t.name.endswith((".attn_k.weight", ".attn_k.bias")):
                heads = config.num_kv_heads
        if keep_quantized and t.tensor_type in KEPT_GGUF_TYPES and len(t.shape) == 2:
            qw = _quantized(header, data, t)
            yield name, qw if heads is None else qw.map_rows(lambda r, h=heads: _unpermute_rope_rows(r, h))
            continue
        tensor = _dequantize(header, data, t)
        if heads is not None:
            tensor = _unpermute_rope_rows(tensor, heads)
        if keep_quantized and requantized(t):
            yield name, int8_groups(tensor)
            continue
        if config.architecture == "gemma3" and name.endswith("norm.weight"):
            tensor = tensor - 1.0  # llama.cpp stores Gemma's (1 + w); Hugging Face names mean w
        yield name, tensor.to(dtype)
