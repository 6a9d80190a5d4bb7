"""llama.cpp's block formats read straight into our int4 and int8 layouts (no float round trip), and the
32-weight ones decoded to floats where a dense model is asked for (gguf_dense).

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
# Bytes per block of the 32-weight types.
BLOCK_BYTES = {QType.Q4_0: 18, QType.Q4_1: 20, QType.Q8_0: 34}


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
        b = blocks.reshape(n, k // 32, BLOCK_BYTES[qtype])
        d = _f16(b[..., 0:2])
        codes, scale, zero = _nibbles(b[..., 2:]), d, np.zeros_like(d)
    elif qtype == QType.Q4_1:
        b = blocks.reshape(n, k // 32, BLOCK_BYTES[qtype])
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
    b = np.asarray(data, dtype=np.uint8).reshape(n, k // 32, BLOCK_BYTES[QType.Q8_0])
    d = _f16(b[..., 0:2])
    codes = np.ascontiguousarray(b[..., 2:]).view(np.int8).reshape(n, k)
    return QuantizedWeight("int8", torch.from_numpy(codes.copy()), torch.from_numpy(np.ascontiguousarray(d)),
                           None, 32)


def gguf_dense(data: np.ndarray, qtype: QType, shape: tuple[int, ...]) -> torch.Tensor:
    """Q4_0, Q4_1 or Q8_0 blocks (`data` as gguf_int4's) as the float32 weights they stand for: gguf's
    own decoder's values bit for bit (the same float32 products and sums, never fused), in torch at
    about twice its speed (the default model's tensors 1.25-1.43 -> 0.72 s of CPU; numpy with this
    module's helpers 0.81-1.02 s; session 27). The packed bytes are copied (a fifth of the floats'
    size or less): torch takes no read-only map."""
    size = BLOCK_BYTES[qtype]
    b = torch.from_numpy(np.array(data, dtype=np.uint8)).view(-1, size)
    d = b[:, 0:2].contiguous().view(torch.float16).float()
    if qtype == QType.Q8_0:
        w = d * b[:, 2:].contiguous().view(torch.int8).float()
    else:
        q = torch.cat([b[:, size - 16:] & 0x0F, b[:, size - 16:] >> 4], dim=1)  # as _nibbles
        if qtype == QType.Q4_0:
            w = d * (q.to(torch.int8) - 8).float()
        else:
            w = d * q.float() + b[:, 2:4].contiguous().view(torch.float16).float()
    return w.reshape(shape)


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
