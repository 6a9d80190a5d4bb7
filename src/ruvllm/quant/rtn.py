"""Round-to-nearest quantization of float weights (no calibration data)."""

from __future__ import annotations

import torch

from ruvllm.quant.weights import INT4_GROUP_SIZES, KERNEL_DTYPE, QuantizedWeight


# Scales are rounded to the dtype the kernels read them in (bf16) before the codes are chosen, so
# the codes are the nearest ones under the scales actually used.


def _rounded(t: torch.Tensor) -> torch.Tensor:
    return t.to(KERNEL_DTYPE).float()


def _round_up(t: torch.Tensor) -> torch.Tensor:
    """Round to KERNEL_DTYPE, upwards (a scale rounded down could leave a group's ends off the grid)."""
    r = t.to(KERNEL_DTYPE)
    low = r.float() < t
    r[low] = torch.nextafter(r[low], torch.full_like(r[low], float("inf")))
    return r.float()


def quantize_int8(w: torch.Tensor) -> QuantizedWeight:
    """Symmetric int8, one scale per output channel (row)."""
    w = w.float()
    scale = _rounded(w.abs().amax(dim=1).clamp(min=1e-8) / 127.0)
    codes = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
    return QuantizedWeight("int8", codes, scale)


def check_int4_group(k: int, group_size: int, name: str = "weight") -> None:
    if group_size not in INT4_GROUP_SIZES:
        raise ValueError(f"int4 group size must be one of {INT4_GROUP_SIZES}, got {group_size}")
    if k % group_size:
        raise ValueError(f"int4 group size {group_size} does not divide the input size {k} of {name}")


def quantize_int4(w: torch.Tensor, group_size: int = 32, name: str = "weight") -> QuantizedWeight:
    """Asymmetric int4 per group of `group_size` inputs: the group's [min, max] spread over 0..15."""
    n, k = w.shape
    check_int4_group(k, group_size, name)
    g = w.float().reshape(n, k // group_size, group_size)
    lo, hi = g.amin(dim=2), g.amax(dim=2)
    # The zero point is rounded first; the scale is then the smallest bf16 value whose grid around
    # that zero still reaches both ends of the group, so every weight lies within half a step.
    zero = _rounded(lo + 8.0 * (hi - lo) / 15.0)
    need = torch.maximum((zero - lo) / 8.0, (hi - zero) / 7.0).clamp(min=1e-8)
    scale = _round_up(need)
    codes = torch.round((g - zero[..., None]) / scale[..., None] + 8.0).clamp(0, 15).to(torch.uint8)
    return QuantizedWeight("int4", codes.reshape(n, k), scale, zero, group_size)
