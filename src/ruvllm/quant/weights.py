"""A quantized weight matrix in the one layout our packed matmuls take, whatever it came from.

int8: w = q * scale (q in [-127, 127]), one scale per output channel, or per group of `group_size`
      inputs (llama.cpp's Q8_0). Our CPU kernel takes both; PyTorch's packed int8 matmul takes
      per-channel scales only, so elsewhere group-wise int8 runs on the int4 kernel as two nibble
      halves (int8_groups_as_int4).
int4: groups of `group_size` along the input dimension, w = (q - 8) * scale + zero (q in [0, 15]).
That int4 form is the one PyTorch's packed int4 matmul computes; it holds llama.cpp's Q4_0
(zero = 0), Q4_1 (zero = min + 8 * d) and Q4_K sub-blocks exactly, before scales are rounded to
the activation dtype.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch

INT4_GROUP_SIZES = (32, 64, 128, 256)  # what the packed int4 kernels accept
INT4_ROWS_MULTIPLE = 16  # the packed int4 layout tiles output rows by 16
# The packed kernels take activations, scales and zero points in bf16 (fed fp32 they are 15-25x slower).
KERNEL_DTYPE = torch.bfloat16


def estimate_bytes(kind: Literal["int8", "int4"], n: int, k: int, group_size: int = 0, cpu: bool = True) -> int:
    """Bytes an [n, k] weight takes in the packed layout, from its shape alone (no tensor needed).

    int8: n*k one-byte codes, plus a 2-byte scale per output channel (group_size 0) or per group.
    Off our CPU kernels (`cpu` False: CUDA, or no compiler) group-wise int8 is held as
    int8_groups_as_int4 makes it, int4 over 2k inputs. int4: n*k/2 bytes (two codes per byte), plus a 2-byte scale and a 2-byte zero point per
    group: what QuantizedWeight.nbytes counts, and QuantLinear's buffers hold.
    """
    if kind == "int8" and group_size and not cpu:
        return estimate_bytes("int4", n, 2 * k, group_size)
    if kind == "int8":
        return n * k + 2 * n * (k // group_size if group_size else 1)
    if kind == "int4":
        if group_size <= 0:
            raise ValueError("int4 weights need a group size")
        return n * k // 2 + 2 * 2 * n * (k // group_size)
    raise ValueError(f"unknown quantized kind {kind!r}")


@dataclass(frozen=True)
class QuantizedWeight:
    kind: Literal["int8", "int4"]
    codes: torch.Tensor  # [N, K]: int8 for int8, uint8 holding 0..15 for int4
    scales: torch.Tensor  # float32: [N] (per channel) or [N, K // group_size]
    zeros: torch.Tensor | None = None  # float32 [N, K // group_size]; int4 only
    group_size: int = 0  # 0: per output channel (int8 only)

    @property
    def shape(self) -> tuple[int, int]:
        return (int(self.codes.shape[0]), int(self.codes.shape[1]))

    @property
    def nbytes(self) -> int:
        """Bytes this weight takes once packed (int4: two codes per byte), scales included."""
        n, k = self.shape
        return estimate_bytes(self.kind, n, k, self.group_size)

    def dequantize(self) -> torch.Tensor:
        """The float32 matrix these codes stand for."""
        g = self.group_size
        if self.kind == "int8":
            scale = self.scales[:, None] if g == 0 else self.scales.repeat_interleave(g, dim=1)
            return self.codes.float() * scale
        scale = self.scales.repeat_interleave(g, dim=1)
        zero = self.zeros.repeat_interleave(g, dim=1)
        return (self.codes.float() - 8.0) * scale + zero

    def to(self, device: torch.device | str) -> QuantizedWeight:
        return self.map_rows(lambda t: t.to(device))

    def map_rows(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> QuantizedWeight:
        """Apply one row reordering (a function of a [N, ...] tensor) to codes, scales and zeros alike."""
        return QuantizedWeight(self.kind, fn(self.codes), fn(self.scales),
                               None if self.zeros is None else fn(self.zeros), self.group_size)


def int8_groups_as_int4(qw: QuantizedWeight) -> QuantizedWeight:
    """Group-wise int8 [N, K] as int4 [N, 2K] over the input repeated twice, [x, x], with the same groups.

    With u = q + 128 = 16 h + l (h, l in 0..15): w = d q = 16 d (h - 8) + d l. The first K columns
    hold h with scale 16 d and zero 0, the last K hold l with scale d and zero 8 d. 16 d and 8 d
    round to bf16 exactly as d does, so the kernel computes bf16(d) * q: the int8 codes themselves.
    """
    if qw.kind != "int8" or qw.group_size not in INT4_GROUP_SIZES:
        raise ValueError(f"expected int8 with groups of {INT4_GROUP_SIZES}, got {qw.kind}/g{qw.group_size}")
    u = qw.codes.to(torch.int16) + 128
    codes = torch.cat([u >> 4, u & 15], dim=1).to(torch.uint8)
    d = qw.scales
    return QuantizedWeight("int4", codes, torch.cat([16.0 * d, d], dim=1),
                           torch.cat([torch.zeros_like(d), 8.0 * d], dim=1), qw.group_size)


def concat_rows(parts: list[QuantizedWeight]) -> QuantizedWeight:
    """Stack weights along the output dimension (q, k, v -> qkv). All parts must share kind and groups."""
    first = parts[0]
    for p in parts[1:]:
        if (p.kind, p.group_size, p.shape[1]) != (first.kind, first.group_size, first.shape[1]):
            raise ValueError(f"cannot fuse {p.kind}/g{p.group_size}/K={p.shape[1]} with "
                             f"{first.kind}/g{first.group_size}/K={first.shape[1]}")
    zeros = None if first.zeros is None else torch.cat([p.zeros for p in parts])
    return QuantizedWeight(first.kind, torch.cat([p.codes for p in parts]), torch.cat([p.scales for p in parts]),
                           zeros, first.group_size)
