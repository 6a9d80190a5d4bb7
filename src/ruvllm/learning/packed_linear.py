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


def grad_input(dy: torch.Tensor, w: cpu_matmul.Packed, wt: cpu_matmul.Packed | None = None) -> torch.Tensor:
    """dy [T, N] float32 . W [N, K] -> [T, K], W the packed weight: with `wt` (transposed_q8(W)) the
    engine's integer kernel over W's transposed 8-bit copy, else the float32 kernel over W's codes."""
    if wt is not None:
        return cpu_matmul.matmul(dy, wt)
    ext = kernels()
    assert ext is not None, "packed weights are only made where the kernels build"
    return ext.quant_matmul_grad_input(dy.float().contiguous(), w.codes, w.scales, w.zeros, w.group, w.int4)


def transposed_q8(w: cpu_matmul.Packed) -> cpu_matmul.Packed:
    """W's transpose [K, N] in 8 bits per block of 32 outputs (Q8_0), for the input gradient's
    integer kernel (issue 37 item 1, session 17: docs/learning.md). The backward's reduction runs
    over W's outputs, along which the served codes have no common scale (their blocks run along the
    inputs), so integer dots need a copy blocked the other way: one byte a weight (+ a float16 scale
    a block), against the 4 or 8 bits served. Its rounding (within 1/254 of a block's largest
    value) is far under the 4-bit codes' own; dY is rounded to 8 bits per block too, as the
    forward's activations are: the same straight-through estimate."""
    from ruvllm.quant.llamacpp import quantize_q8

    return cpu_matmul.pack(quantize_q8(cpu_matmul.dequantize(w).t().contiguous()))


class PackedLoraMatmul(torch.autograd.Function):
    """y = x . W^T (+ bias) over a packed W, with micro-LoRA deltas scaling * (x A^T) B^T added into
    column spans of y (a fused projection's learned pieces), as one autograd node (issue 37 item 1).

    The packed matmul, then each piece's delta added in place into the fresh output by one C++ call
    (learning/csrc/micro_lora.cpp, session 18; before, two products and a slice a piece), and the
    backward written out: the input gradient through the packed weights, then one C++ call a piece
    for A's and B's gradients (from the saved rank-r product) and the delta's share of the input
    gradient. With no pieces it is the packed matmul alone (packed_linear), differentiable in x
    only. At a dozen rows each autograd node's bookkeeping and each small op counts: one node instead
    of a dozen measured ~2% of the step (docs/learning.md, "Session 17"), the pieces' torch ops
    ~150 us a piece ("Session 18"). Old-style forward(ctx, ...): a Function with setup_context has
    its arguments bound through inspect.signature at every call.
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: cpu_matmul.Packed, wt: cpu_matmul.Packed | None,  # type: ignore[override]
                bias: torch.Tensor | None, scaling: float, spans: tuple[tuple[int, int], ...],
                *ab: torch.Tensor) -> torch.Tensor:
        y = cpu_matmul.matmul(x, w)
        if bias is not None:
            y += bias
        us = []
        if spans:
            ext, x = kernels(), x.contiguous()
            for (lo, _), a, b in zip(spans, ab[0::2], ab[1::2]):
                # one C++ call (learning/csrc/micro_lora.cpp): the rank-r product u = x A^T, kept for
                # B's gradient, and its delta added into the piece's columns
                us.append(ext.micro_lora_add_(y, x, a.detach(), b.detach(), lo, scaling))
        ctx.save_for_backward(x, *ab, *us)
        ctx.w, ctx.wt, ctx.scaling, ctx.spans = w, wt, scaling, spans
        return y

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple:  # type: ignore[override]
        x, *rest = ctx.saved_tensors
        n, s = len(ctx.spans), ctx.scaling
        ab, us = rest[:2 * n], rest[2 * n:]
        dy = dy.contiguous()
        # (not asked for the first learned layer's q/k/v, whose input comes from the frozen layers)
        dx = grad_input(dy, ctx.w, ctx.wt) if ctx.needs_input_grad[0] else None
        grads: list[torch.Tensor | None] = []
        ext = kernels() if ctx.spans else None
        for i, (lo, _) in enumerate(ctx.spans):
            # one C++ call: A's and B's gradients, and the delta's share of dx added into it
            da, db = ext.micro_lora_grad(dy, x, us[i], ab[2 * i].detach(), ab[2 * i + 1].detach(), lo, s, dx)
            grads.append(da if ctx.needs_input_grad[6 + 2 * i] else None)
            grads.append(db if ctx.needs_input_grad[7 + 2 * i] else None)
        return (dx, None, None, None, None, None, *grads)


def packed_lora_linear(x: torch.Tensor, w: cpu_matmul.Packed, bias: torch.Tensor | None, scaling: float,
                       pieces: list[tuple[int, int, torch.Tensor, torch.Tensor]],
                       wt: cpu_matmul.Packed | None = None) -> torch.Tensor:
    """PackedLoraMatmul of `pieces`: (first column, end column, A [r, K], B [hi - lo, r]) each; the
    input gradient through `wt` (transposed_q8(W)) when given."""
    spans = tuple((lo, hi) for lo, hi, _, _ in pieces)
    return PackedLoraMatmul.apply(x, w, wt, bias, scaling, spans, *[t for _, _, a, b in pieces for t in (a, b)])


def packed_linear(x: torch.Tensor, w: cpu_matmul.Packed, bias: torch.Tensor | None = None,
                  wt: cpu_matmul.Packed | None = None) -> torch.Tensor:
    """x . W^T (+ bias) over packed W, differentiable in x (its backward through `wt`,
    transposed_q8(W), when given): PackedLoraMatmul without pieces."""
    return PackedLoraMatmul.apply(x, w, wt, bias, 1.0, ())
