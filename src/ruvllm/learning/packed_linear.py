"""A linear layer over the served packed weights that autograd can run backward through.

The forward is the engine's own quantized matmul (quant/cpu_matmul.py: activations to 8 bits per
block, exact integer block dots), so the learner computes what serving computes. The backward gives
the input's gradient, dx = dy . W, from the same packed codes (quant/csrc/quant_matmul_grad.cpp:
each block dequantized once per call, a fixed FMA order per output, batch invariant as the forward
is). The activations' rounding in the forward is taken as the identity there (a straight-through
estimate): its error is within the quantization's, and the weights, frozen, need no gradient.
"""

from __future__ import annotations

from typing import Any

import torch

from ruvllm.cpu_build import kernels
from ruvllm.quant import cpu_matmul


def grad_input(dy: torch.Tensor, w: cpu_matmul.Packed) -> torch.Tensor:
    """dy [T, N] float32 . W [N, K] -> [T, K], W the packed weight."""
    ext = kernels()
    assert ext is not None, "packed weights are only made where the kernels build"
    return ext.quant_matmul_grad_input(dy.float().contiguous(), w.codes, w.scales, w.zeros, w.group, w.int4)


class PackedMatmul(torch.autograd.Function):
    """y = x . W^T over a packed W (cpu_matmul.Packed), differentiable in x only."""

    @staticmethod
    def forward(x: torch.Tensor, w: cpu_matmul.Packed) -> torch.Tensor:  # type: ignore[override]
        return cpu_matmul.matmul(x, w)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: torch.Tensor) -> None:
        ctx.w = inputs[1]

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor | None, None]:  # type: ignore[override]
        # (autograd asks only where x needs it: not for the first learned layer's q/k/v, whose
        # input comes from the frozen layers below)
        return (grad_input(dy, ctx.w) if ctx.needs_input_grad[0] else None), None


def packed_linear(x: torch.Tensor, w: cpu_matmul.Packed, bias: torch.Tensor | None = None) -> torch.Tensor:
    y = PackedMatmul.apply(x, w)
    return y if bias is None else y + bias
