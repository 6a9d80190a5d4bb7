"""Hugging Face GPTQ and AWQ checkpoints (`quantization_config` in config.json) read into our int4 layout.

Both store, per linear layer, int4 codes packed eight to an int32, int4 zero points packed the
same way, and fp16 scales per group of input channels; a weight is w = (q - z) * s. In our form,
w = (q - 8) * scale + zero, so scale = s and zero = (8 - z) * s: exact.
- GPTQ: `qweight` [K/8, N] packs along the input dimension (bits 4j..4j+3 of row i hold input
  8i + j); `qzeros` [G, N/8] packs along the output dimension; `g_idx` [K] gives each input's group.
  The original ("gptq", v1) format stores zero points minus one; "gptq_v2" stores them as they are.
- AWQ (GEMM): `qweight` [K, N/8] and `qzeros` [G, N/8] pack along the output dimension, with the
  eight columns of an int32 in the order 0, 2, 4, 6, 1, 3, 5, 7; no g_idx.
The packing in both directions lives here: reading (`to_quantized`) and writing AWQ files
(`awq_parts`, used by `ruvllm quantize`).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from ruvllm.errors import CorruptModelError
from ruvllm.quant.checkpoint_scheme import CheckpointQuant
from ruvllm.quant.rtn import quantize_int8
from ruvllm.quant.weights import INT4_GROUP_SIZES, QuantizedWeight

_SHIFTS = torch.arange(0, 32, 4, dtype=torch.int32)
# Position, within an AWQ int32, of each of the eight output columns it holds ...
_AWQ_COLUMN_TO_NIBBLE = [0, 4, 1, 5, 2, 6, 3, 7]
# ... and the inverse: the output column each nibble holds.
_AWQ_NIBBLE_TO_COLUMN = [0, 2, 4, 6, 1, 3, 5, 7]


def _unpack(packed: torch.Tensor, dim: int) -> torch.Tensor:
    """int32 words -> eight 4-bit values each, expanded along `dim` (low nibble first)."""
    nib = (packed.to(torch.int32).unsqueeze(-1) >> _SHIFTS) & 0xF  # [..., 8]
    if dim == 0:
        return nib.permute(0, 2, 1).reshape(packed.shape[0] * 8, packed.shape[1])
    return nib.reshape(packed.shape[0], packed.shape[1] * 8)


def _pack(values: torch.Tensor) -> torch.Tensor:
    """[R, C] values 0..15 -> [R, C/8] int32 words, eight consecutive columns a word, low nibble
    first: the inverse of _unpack(., 1)."""
    r, c = values.shape
    if c % 8:
        raise ValueError(f"{c} columns do not pack eight to an int32")
    nib = values.to(torch.int64).reshape(r, c // 8, 8)
    if nib.min() < 0 or nib.max() > 15:
        raise ValueError("4-bit values must lie in 0..15")
    word = (nib << _SHIFTS.to(torch.int64)).sum(dim=-1)  # < 2**32
    return torch.where(word >= 2**31, word - 2**32, word).to(torch.int32)  # the same bits, signed


def awq_unpack(packed: torch.Tensor) -> torch.Tensor:
    """AWQ GEMM words [R, N/8] -> values [R, N] (int32) in output-column order."""
    n8 = packed.shape[1]
    return _unpack(packed, 1).view(-1, n8, 8)[:, :, _AWQ_COLUMN_TO_NIBBLE].reshape(-1, n8 * 8)


def awq_pack(values: torch.Tensor) -> torch.Tensor:
    """Values [R, N] (0..15) -> AWQ GEMM words [R, N/8]: the inverse of awq_unpack."""
    r, n = values.shape
    if n % 8:
        raise ValueError(f"AWQ packs output columns eight to an int32; {n} is not a multiple of 8")
    return _pack(values.reshape(r, n // 8, 8)[:, :, _AWQ_NIBBLE_TO_COLUMN].reshape(r, n))


def awq_parts(qw: QuantizedWeight) -> dict[str, torch.Tensor]:
    """An int4 QuantizedWeight whose zero points are whole steps (zero = (8 - z) * scale, z in 0..15,
    as rtn.quantize_int4_checkpoint makes them) -> AWQ GEMM `qweight`, `qzeros`, `scales` (fp16):
    the inverse of to_quantized for AWQ. Raises ValueError for weights the format cannot hold."""
    if qw.kind != "int4" or qw.zeros is None:
        raise ValueError(f"AWQ holds int4 weights with zero points, not {qw.kind}")
    z = 8.0 - qw.zeros / qw.scales
    zi = torch.round(z)
    if not torch.equal(z, zi) or zi.min() < 0 or zi.max() > 15:
        raise ValueError("zero points are not whole steps 0..15 of the scale (AWQ stores integer zero points)")
    scales = qw.scales.to(torch.float16)
    if not torch.equal(scales.float(), qw.scales):
        raise ValueError("scales are not exact in fp16 (AWQ stores fp16 scales)")
    return {"qweight": awq_pack(qw.codes.t()),  # [K, N/8]
            "qzeros": awq_pack(zi.t().to(torch.int32)),  # [G, N/8]
            "scales": scales.t().contiguous()}  # [G, N]


def to_quantized(scheme: CheckpointQuant, parts: dict[str, torch.Tensor],
                 name: str) -> QuantizedWeight | torch.Tensor:
    """One layer's parts -> an int4 QuantizedWeight when its groups fit our kernels, else the exact
    float weight [N, K] (act-order g_idx, per-channel or odd group sizes)."""
    try:
        scales = parts["scales"].float()  # [G, N]
        if scheme.method == "gptq":
            codes = _unpack(parts["qweight"], 0)  # [K, N]
            zeros = _unpack(parts["qzeros"], 1) + scheme.zero_offset  # [G, N]
        else:
            codes = awq_unpack(parts["qweight"])
            zeros = awq_unpack(parts["qzeros"])
        k, n = codes.shape
        groups = scales.shape[0]
        if zeros.shape != (groups, n) or scales.shape[1] != n or k % groups:
            raise ValueError(f"qweight {tuple(codes.shape)}, qzeros {tuple(zeros.shape)}, scales {tuple(scales.shape)}")
        group = k // groups
        in_order = torch.arange(k) // group
        g_idx = parts.get("g_idx")
        if g_idx is not None and g_idx.numel() != k:
            raise ValueError(f"g_idx has {g_idx.numel()} entries for {k} inputs")
    except (KeyError, RuntimeError, ValueError) as e:
        raise CorruptModelError(f"{name}: malformed {scheme.method} tensors ({e})") from None
    if (g_idx is None or torch.equal(g_idx.long(), in_order)) and group in INT4_GROUP_SIZES and n % 16 == 0:
        # [K, N] -> our [N, K] rows; scale and zero per (row, group).
        return QuantizedWeight("int4", codes.t().to(torch.uint8).contiguous(), scales.t().contiguous(),
                               ((8 - zeros.float()) * scales).t().contiguous(), group)
    gi = in_order if g_idx is None else g_idx.long()
    return ((codes.float() - zeros.float()[gi]) * scales[gi]).t().contiguous()


def assemble(stream: Iterator[tuple[str, torch.Tensor]], scheme: CheckpointQuant, source: str,
             keep_quantized: bool) -> Iterator[tuple[str, torch.Tensor | QuantizedWeight]]:
    """Pass plain tensors through; gather each quantized layer's parts and yield `<layer>.weight`:
    packed (int4, or per-channel int8 when the groups do not fit, the packed form that loses least)
    with keep_quantized, else its exact float values."""
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in stream:
        prefix, _, part = name.rpartition(".")
        if part not in scheme.parts:
            yield name, tensor
            continue
        parts = pending.setdefault(prefix, {})
        parts[part] = tensor
        if all(p in parts for p in scheme.parts):
            del pending[prefix]
            weight = to_quantized(scheme, parts, f"{source}: {prefix}")
            if not keep_quantized:
                weight = weight.dequantize() if isinstance(weight, QuantizedWeight) else weight
            elif not isinstance(weight, QuantizedWeight):
                weight = quantize_int8(weight)
            yield f"{prefix}.weight", weight
    if pending:
        prefix, parts = next(iter(pending.items()))
        missing = [p for p in scheme.parts if p not in parts]
        raise CorruptModelError(f"{source}: {prefix} lacks {', '.join(missing)} of its {scheme.method} tensors")
