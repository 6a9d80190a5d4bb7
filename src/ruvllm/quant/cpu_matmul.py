"""Our C++ quantized matmul for the CPU (csrc/quant_matmul.cpp): 4- and 8-bit weights in blocks of 32
inputs, each activation row quantized to 8 bits per block of 32 (llama.cpp's scheme), exact integer
block dots (AVX2 where the CPU has it), threads over the output features. Every output row is
computed the same way at any row count, so results are batch invariant.

`pack(qw)` turns a QuantizedWeight into the kernel's layout once, at load; `matmul(x, packed)` runs it;
`dequantize(packed)` reads the layout back as float32.
The packed bytes are what `estimate_bytes` counts for int4 and per-channel int8.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ruvllm.cpu_build import kernels
from ruvllm.quant.weights import QuantizedWeight

BLOCK = 32  # inputs per block, for weights and activations alike
TILE_ROWS = 4  # weight rows the kernel decodes together: N must be a multiple of it


@dataclass(frozen=True)
class Packed:
    int4: bool
    codes: torch.Tensor  # int4: [N, K/2] uint8, two codes a byte (Q4_0 order); int8: [N, K] int8
    scales: torch.Tensor  # [N/4, K/group, 4] float16 bits as int16
    zeros: torch.Tensor | None  # [N/4, K/group, 4] float16 bits as int16; int4 only
    group: int  # inputs per scale: the weight's group size, or K for a per-channel int8 scale

    @property
    def nbytes(self) -> int:
        parts = (self.codes, self.scales) + (() if self.zeros is None else (self.zeros,))
        return sum(t.numel() * t.element_size() for t in parts)


def pack(qw: QuantizedWeight) -> Packed:
    """The kernel's layout of a weight (K and the group size multiples of 32, N of 4; the kernel
    checks): codes as they are (int4: two a byte), scales and zero points in float16, one per group
    (2 bytes each, as the weight plan counts them; GGUF stores its block scales in float16 too),
    laid out [N/4, K/group, 4] so that a tile of 4 rows reads its 4 scales of a group at once."""
    n, k = qw.shape
    group = qw.group_size or k

    def tiled(t: torch.Tensor) -> torch.Tensor:
        t = t if t.dim() == 2 else t[:, None]
        # float16 values held as int16 bits: a module's dtype cast (.to(torch.bfloat16)) skips them
        return t.half().reshape(n // TILE_ROWS, TILE_ROWS, -1).transpose(1, 2).contiguous().view(torch.int16)

    if qw.kind == "int8":
        return Packed(False, qw.codes.to(torch.int8).contiguous(), tiled(qw.scales), None, group)
    codes = qw.codes.to(torch.uint8).reshape(n, k // BLOCK, 2, BLOCK // 2)
    packed = (codes[:, :, 0] | (codes[:, :, 1] << 4)).reshape(n, k // 2).contiguous()
    assert qw.zeros is not None
    return Packed(True, packed, tiled(qw.scales), tiled(qw.zeros), group)


def dequantize(w: Packed) -> torch.Tensor:
    """The float32 [N, K] matrix a packed weight stands for, as the kernels read it: int4 (q - 8) *
    scale + zero, int8 q * scale, the scales and zeros in float16 (pack's layout undone; the
    learner's transposed 8-bit copy is made from it: learning/packed_linear.py)."""
    n = w.codes.shape[0]
    if w.int4:
        c = w.codes.reshape(n, -1, BLOCK // 2)  # a block's 16 bytes: codes j (low) and 16 + j (high)
        q = torch.stack([c & 0x0F, c >> 4], dim=2).reshape(n, -1).float() - 8.0
    else:
        q = w.codes.float()
    k = q.shape[1]

    def per_input(t: torch.Tensor) -> torch.Tensor:  # [N/4, K/group, 4] float16 bits -> [N, K]
        t = t.view(torch.float16).transpose(1, 2).reshape(n, -1).float()
        return t.repeat_interleave(w.group, dim=1) if w.group != k else t.expand(n, k)

    out = q * per_input(w.scales)
    return out + per_input(w.zeros) if w.zeros is not None else out


def matmul(x: torch.Tensor, w: Packed) -> torch.Tensor:
    """x [T, K] (any float dtype) . W^T -> [T, N] in x's dtype."""
    ext = kernels()
    assert ext is not None, "check kernels() before packing for it"
    xf = x if x.dtype == torch.float32 and x.is_contiguous() else x.float().contiguous()
    y = ext.quant_matmul(xf, w.codes, w.scales, w.zeros, w.group, w.int4)
    return y if y.dtype == x.dtype else y.to(x.dtype)
