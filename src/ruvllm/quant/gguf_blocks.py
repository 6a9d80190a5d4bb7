"""llama.cpp's 4-bit block formats read straight into our int4 layout (no float round trip).

Q4_0 (32 weights: f16 d, 16 bytes of nibbles): w = d * (q - 8)            -> scale d, zero 0
Q4_1 (32 weights: f16 d, f16 m, nibbles):      w = d * q + m               -> scale d, zero m + 8d
Q8_0 (32 weights: f16 d, 32 int8):           w = d * q                   -> int8, scale d per group
Q4_K (256 weights: f16 d, f16 dmin, 12 bytes of 6-bit sub-block scales and mins, 128 bytes of nibbles),
     eight sub-blocks of 32: w = d*sc * q - dmin*mn                       -> scale d*sc, zero 8*d*sc - dmin*mn
In a 32-weight block the low nibbles hold weights 0-15 and the high nibbles 16-31; in Q4_K each
32-byte run holds two sub-blocks the same way.
"""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGMLQuantizationType as QType
from gguf.quants import Q4_K

from ruvllm.quant.weights import QuantizedWeight

INT4_GGUF_TYPES = frozenset({QType.Q4_0, QType.Q4_1, QType.Q4_K})
KEPT_GGUF_TYPES = INT4_GGUF_TYPES | {QType.Q8_0}
# Types with no kernel of ours, held as Q8_0-like int8 groups of 32 (requantized from their float
# values: each group's step is its absmax / 127, a fraction of the source's own 5- or 6-bit step),
# rather than as dense floats that would make a one-row matmul read 4-8x the bytes.
REQUANTIZED_GGUF_TYPES = frozenset({QType.Q5_0, QType.Q5_1, QType.Q6_K, QType.Q2_K, QType.Q3_K, QType.Q5_K})


def _f16(raw: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(raw).view(np.float16).astype(np.float32)[..., 0]


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """[..., B] bytes -> [..., 2B] codes: low nibbles first, then high nibbles."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def gguf_int4(data: np.ndarray, qtype: QType, shape: tuple[int, int]) -> QuantizedWeight:
    """`data`: the tensor's raw bytes, [rows, bytes per row] uint8 (loader/gguf_file.py tensor_bytes)."""
    n, k = shape
    blocks = np.asarray(data, dtype=np.uint8).reshape(n, -1)
    if qtype == QType.Q4_0:
        b = blocks.reshape(n, k // 32, 18)
        d = _f16(b[..., 0:2])
        codes, scale, zero = _nibbles(b[..., 2:]), d, np.zeros_like(d)
    elif qtype == QType.Q4_1:
        b = blocks.reshape(n, k // 32, 20)
        d, m = _f16(b[..., 0:2]), _f16(b[..., 2:4])
        codes, scale, zero = _nibbles(b[..., 4:]), d, m + 8.0 * d
    elif qtype == QType.Q4_K:
        b = blocks.reshape(n * (k // 256), 144)
        d, dmin = _f16(b[:, 0:2]), _f16(b[:, 2:4])
        sc, mn = Q4_K.get_scale_min(np.ascontiguousarray(b[:, 4:16]))
        scale = d[:, None] * sc.astype(np.float32)  # [blocks, 8]
        zero = 8.0 * scale - dmin[:, None] * mn.astype(np.float32)
        codes = _nibbles(b[:, 16:].reshape(-1, 4, 32))  # [blocks, 4 runs, 64 codes]
        scale, zero = scale.reshape(n, k // 32), zero.reshape(n, k // 32)
    else:
        raise ValueError(f"{qtype.name} has no int4 form")
    codes = np.ascontiguousarray(codes).reshape(n, k)
    return QuantizedWeight("int4", torch.from_numpy(codes.astype(np.uint8)),
                           torch.from_numpy(np.ascontiguousarray(scale, dtype=np.float32)).reshape(n, k // 32),
                           torch.from_numpy(np.ascontiguousarray(zero, dtype=np.float32)).reshape(n, k // 32), 32)


def gguf_int8(data: np.ndarray, shape: tuple[int, int]) -> QuantizedWeight:
    """Q8_0 blocks as group-wise int8 (exact)."""
    n, k = shape
    b = np.asarray(data, dtype=np.uint8).reshape(n, k // 32, 34)
    d = _f16(b[..., 0:2])
    codes = np.ascontiguousarray(b[..., 2:]).view(np.int8).reshape(n, k)
    return QuantizedWeight("int8", torch.from_numpy(codes.copy()), torch.from_numpy(np.ascontiguousarray(d)),
                           None, 32)


def int8_groups(w: torch.Tensor) -> QuantizedWeight:
    """A float matrix [N, K] (K a multiple of 32) as int8 codes with one scale per 32 inputs (round to nearest)."""
    n, k = w.shape
    g = w.float().reshape(n, k // 32, 32)
    scale = g.abs().amax(-1) / 127.0
    codes = torch.where(scale[..., None] > 0, g / scale.clamp_min(torch.finfo(torch.float32).tiny)[..., None],
                        torch.zeros(()))
    return QuantizedWeight("int8", codes.round().clamp(-127, 127).to(torch.int8).reshape(n, k), scale, None, 32)


def gguf_quantized(data: np.ndarray, qtype: QType, shape: tuple[int, int]) -> QuantizedWeight:
    if qtype == QType.Q8_0:
        return gguf_int8(data, shape)
    return gguf_int4(data, qtype, shape)
