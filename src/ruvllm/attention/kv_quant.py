"""The cold tier's K/V format: each (token, KV head) row of head_dim values quantized on its own.

int8: symmetric, codes in [-127, 127], one fp16 scale per row: x ~ q * s, s = max|x| / 127.
int4: asymmetric, codes in [0, 15] (two per byte, even index in the low nibble), fp16 scale and
      minimum per row: x ~ q * s + m, m = min(x), s = (max(x) - m) / 15.

Why per row (docs/quantization.md, "Two-tier KV cache"): it needs no state beyond the row itself, so
a block can be quantized the moment it leaves the hot window and a row reads the same whether its
block has moved or is fake-quantized in place; measured on the default model with a 64-token hot
window it costs +0.14% (int8) and +0.80% (int4) perplexity over the 16-bit cache.

This is the PyTorch reference; the C++ kernel (csrc/paged_attention.cpp) has its twin. Each path
quantizes with its own code and reads with its own code, so within one path a row read dequantized
from the cold tier equals the row fake-quantized from the hot tier bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

KV_BITS = {"int8": 8, "int4": 4}
_FP16_MAX = 65504.0


@dataclass(frozen=True, slots=True)
class KVTier:
    """What attention needs to know about the cold tier for a step (the same for every layer)."""

    num_hot_blocks: int  # block ids >= this are cold
    hot_tokens: int  # a query at p reads block i dequantized when (i + 1) * block_size <= p + 1 - hot_tokens
    bits: int  # 8 or 4


@dataclass(slots=True)
class ColdLayer:
    """One layer's cold store: codes [cold_slots, Hkv, code_width], meta [cold_slots, Hkv, meta_width]
    (fp16 scale, and for int4 the minimum). Slot (block - num_hot_blocks) * block_size + offset."""

    k_codes: torch.Tensor
    v_codes: torch.Tensor
    k_meta: torch.Tensor
    v_meta: torch.Tensor


def code_width(head_dim: int, bits: int) -> int:
    if bits == 4 and head_dim % 2:
        raise ValueError(f"int4 KV codes pack two values a byte: head_dim {head_dim} must be even")
    return head_dim if bits == 8 else head_dim // 2


def meta_width(bits: int) -> int:
    return 1 if bits == 8 else 2


def code_dtype(bits: int) -> torch.dtype:
    return torch.int8 if bits == 8 else torch.uint8


def cold_bytes_per_row(head_dim: int, bits: int) -> int:
    """Bytes of one (token, KV head) row in the cold tier: codes plus fp16 metadata."""
    return code_width(head_dim, bits) + 2 * meta_width(bits)


def _fp16(x: torch.Tensor) -> torch.Tensor:
    return x.clamp(-_FP16_MAX, _FP16_MAX).to(torch.float16)


def quantize_rows(x: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] (any float dtype) -> codes [..., code_width], meta [..., meta_width] fp16."""
    x = x.float()
    if bits == 8:
        scale = _fp16(x.abs().amax(-1, keepdim=True) / 127)
        s = scale.float()
        inv = torch.where(s > 0, 1 / s, torch.zeros_like(s))
        return (x * inv).round_().clamp_(-127, 127).to(torch.int8), scale
    if bits != 4:
        raise ValueError(f"KV codes are 8 or 4 bits, got {bits}")
    minimum = _fp16(x.amin(-1, keepdim=True))
    m = minimum.float()
    scale = _fp16((x.amax(-1, keepdim=True) - m).clamp_(min=0) / 15)
    s = scale.float()
    inv = torch.where(s > 0, 1 / s, torch.zeros_like(s))
    q = ((x - m) * inv).round_().clamp_(0, 15).to(torch.uint8)
    return q[..., 0::2] | (q[..., 1::2] << 4), torch.cat([scale, minimum], -1)


def dequantize_rows(codes: torch.Tensor, meta: torch.Tensor, bits: int) -> torch.Tensor:
    """codes [..., code_width], meta [..., meta_width] -> float32 [..., D]."""
    s = meta[..., :1].float()
    if bits == 8:
        return codes.float() * s
    q = torch.stack([codes & 15, codes >> 4], -1).flatten(-2)
    return q.float() * s + meta[..., 1:2].float()


def fake_quantize(x: torch.Tensor, bits: int) -> torch.Tensor:
    """What the cold tier would return for x, in x's dtype."""
    return dequantize_rows(*quantize_rows(x, bits), bits).to(x.dtype)


def check_kv_cache_dtype(kv_cache_dtype: str, dtype: torch.dtype, device: torch.device, attention: str) -> None:
    """Refuse KV settings this engine cannot honour, with the reason and what to use instead."""
    named = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(kv_cache_dtype)
    if named is not None and named != dtype:
        raise ValueError(f"kv_cache_dtype {kv_cache_dtype!r} needs the model to compute in {kv_cache_dtype} "
                         f"(the hot KV cache is held in the compute dtype, here {str(dtype).removeprefix('torch.')}); "
                         f"set dtype to {str(named).removeprefix('torch.')} or use kv_cache_dtype 'auto'")
    if kv_cache_dtype in KV_BITS:
        if attention == "triton":
            raise ValueError(f"kv_cache_dtype {kv_cache_dtype!r} needs attention 'auto' or 'torch' (our CPU "
                             "kernel, or PyTorch's ops on any device); the Triton kernel reads no quantized KV blocks")
