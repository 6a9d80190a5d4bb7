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


# fp16 normal range: a bf16 scale inside it is exact in fp16, the type GPTQ/AWQ files store scales in.
_FP16_MIN_NORMAL = 2.0 ** -14
FP16_MAX = 65504.0


def int4_checkpoint_grid(w: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Round-to-nearest int4 in the form GPTQ/AWQ checkpoints store: w = (q - z) * s with an integer
    zero point z in 0..15, per group of `group_size` inputs of w [N, K].

    Returns codes [N, K/g, g] (float, 0..15), s and z [N, K/g] (float). With z an integer the grid
    always holds 0, so each group's range is first widened to include 0; of the two integer zero
    points nearest the ideal one, the one needing the smaller step is taken, and the step is then
    rounded up to a bf16 value (our kernels read scales in bf16; such a value is exact in the file's
    fp16 too). The grid covers the whole group, so every weight is within half a step.
    """
    n, k = w.shape
    g = w.float().reshape(n, k // group_size, group_size)
    lo = g.amin(dim=2).clamp(max=0.0)
    hi = g.amax(dim=2).clamp(min=0.0)
    ideal = (-lo / ((hi - lo) / 15.0).clamp(min=1e-30)).clamp(0.0, 15.0)
    best_s = best_z = None
    for z in (ideal.floor(), ideal.ceil()):
        # The smallest step at which z * s reaches down to lo and (15 - z) * s up to hi.
        s = torch.maximum(-lo / z.clamp(min=1e-30), hi / (15.0 - z).clamp(min=1e-30))
        if best_s is None:
            best_s, best_z = s, z
        else:
            better = s < best_s
            best_s, best_z = torch.where(better, s, best_s), torch.where(better, z, best_z)
    scale = _round_up(best_s.clamp(_FP16_MIN_NORMAL, FP16_MAX))
    codes = (g / scale[..., None]).add_(best_z[..., None]).round_().clamp_(0, 15)  # in place: one new tensor
    return codes, scale, best_z


def quantize_int4_checkpoint(w: torch.Tensor, group_size: int = 128, name: str = "weight") -> QuantizedWeight:
    """int4_checkpoint_grid as a QuantizedWeight: scale s, zero (8 - z) * s (exact in float32)."""
    n, k = w.shape
    check_int4_group(k, group_size, name)
    codes, scale, z = int4_checkpoint_grid(w, group_size)
    return QuantizedWeight("int4", codes.reshape(n, k).to(torch.uint8), scale, (8.0 - z) * scale, group_size)
