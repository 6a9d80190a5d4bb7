"""The definition our CPU quantized matmul (quant/csrc/quant_matmul.cpp) is held to, in plain PyTorch."""

from __future__ import annotations

import torch

from ruvllm.quant.weights import QuantizedWeight


def eight_bit_block_reference(x: torch.Tensor, qw: QuantizedWeight) -> torch.Tensor:
    """What the kernel computes (float64): x [T, K] rounded to 8 bits per block of 32 (scale absmax
    / 127), times the weight dequantized with its scales and zeros rounded to float16 (as
    cpu_matmul.pack holds them)."""
    t, k = x.shape
    xb = x.double().reshape(t, k // 32, 32)
    scale = xb.abs().amax(dim=2, keepdim=True) / 127.0
    q = torch.where(scale > 0, torch.round(xb / torch.where(scale > 0, scale, 1.0)), 0.0).clamp(-127, 127)
    held = QuantizedWeight(qw.kind, qw.codes, qw.scales.half().float(),
                           None if qw.zeros is None else qw.zeros.half().float(), qw.group_size)
    return (q * scale).reshape(t, k) @ held.dequantize().double().t()
