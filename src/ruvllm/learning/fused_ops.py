"""The learned layers' element-wise ops as single autograd nodes (issue 37 item 1, session 17).

The learner runs its last layers with autograd at a dozen rows, where each op's arithmetic is tiny
and the step's time outside the matmul kernels went to the many small ops of the torch reference
ops (layers/ops.py: the residual add and the norm's pieces, SiLU's chunk and product, RoPE's split,
negation, concatenation and products for q and k) and to autograd's bookkeeping for each. Here each
op is one node: its forward is our C++ kernel, the one serving runs (layers/csrc/fused_ops.cpp
through layers.ops.cpu_ops), and its backward one C++ call over the saved inputs
(learning/csrc/element_grad.cpp, session 18: written out in torch ops each took 8-12 ops, ~2.3 ms
of a ~23 ms step in all). The weights of the norms are frozen: no gradient is computed for them.

`learner_ops(kernels)` is a LayerOps for LearnedLayers; tests/unit/test_learning_fused.py checks
each op's output and input gradient against the torch reference's autograd.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.autograd import Function

from ruvllm.layers.ops import LayerOps, _torch_rms_norm, _torch_rope


class _RmsNorm(Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, eps: float, ext: Any) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(x, weight)
        ctx.eps, ctx.ext = eps, ext
        return ext.rms_norm(x, weight, eps)

    @staticmethod
    def backward(ctx: Any, dh: torch.Tensor) -> tuple:  # type: ignore[override]
        x, weight = ctx.saved_tensors
        return ctx.ext.rms_norm_grad(dh.contiguous(), x, weight, ctx.eps, None), None, None, None


class _AddRmsNorm(Function):
    """(rms_norm(x + residual) * weight, x + residual): the residual stream's sum and its norm."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,  # type: ignore[override]
                ext: Any) -> tuple[torch.Tensor, torch.Tensor]:
        h, s = ext.add_rms_norm(x, residual, weight, eps)
        ctx.save_for_backward(s, weight)
        ctx.eps, ctx.ext = eps, ext
        ctx.set_materialize_grads(False)
        return h, s

    @staticmethod
    def backward(ctx: Any, dh: torch.Tensor | None, ds: torch.Tensor | None) -> tuple:  # type: ignore[override]
        s, weight = ctx.saved_tensors
        if dh is None:
            grad = ds
        else:  # (the residual stream's own gradient added in the same pass)
            grad = ctx.ext.rms_norm_grad(dh.contiguous(), s, weight, ctx.eps, None if ds is None else ds.contiguous())
        return grad, grad, None, None, None


class _SiluAndMul(Function):
    """silu(gate) * up over gate_up = [gate, up]."""

    @staticmethod
    def forward(ctx: Any, gate_up: torch.Tensor, ext: Any) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(gate_up)
        ctx.ext = ext
        return ext.silu_and_mul(gate_up)

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple:  # type: ignore[override]
        (gate_up,) = ctx.saved_tensors
        return ctx.ext.silu_and_mul_grad(dy.contiguous(), gate_up), None


class _QkvRope(Function):
    """The fused projection's output split into q, k, v heads, RoPE on q and k."""

    @staticmethod
    def forward(ctx: Any, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, hq: int, hkv: int, d: int,  # type: ignore[override]
                ext: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        ctx.save_for_backward(cos, sin)
        ctx.set_materialize_grads(False)
        ctx.shape, ctx.ext = (hq, hkv, d), ext
        return ext.qkv_rope(qkv, cos, sin, hq, hkv, d)

    @staticmethod
    def backward(ctx: Any, dq: torch.Tensor | None, dk: torch.Tensor | None,  # type: ignore[override]
                 dv: torch.Tensor | None) -> tuple:
        cos, sin = ctx.saved_tensors
        grads = [None if g is None else g.contiguous() for g in (dq, dk, dv)]
        return ctx.ext.qkv_rope_grad(*grads, cos.contiguous(), sin.contiguous(), *ctx.shape), \
            None, None, None, None, None, None


def learner_ops(ext: Any) -> LayerOps:
    """LayerOps for the learned layers: our kernels forward (`ext`: cpu_build.kernels()), one autograd
    node an op. Shapes the kernels do not take (a norm over heads' views) keep the torch reference."""
    def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            return rms_norm(x, weight, eps), x
        return _AddRmsNorm.apply(x.contiguous(), residual.contiguous(), weight, eps, ext)

    def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        if x.dim() != 2 or not x.is_contiguous():
            return _torch_rms_norm(x, weight, eps)
        return _RmsNorm.apply(x, weight, eps, ext)

    def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
        return _SiluAndMul.apply(gate_up.contiguous(), ext)

    def qkv_rope(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, hq: int, hkv: int, d: int
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return _QkvRope.apply(qkv.contiguous(), cos, sin, hq, hkv, d, ext)

    # (q/k norms: the models that have them take the layer's separate rms_norm and rope; the served
    # fused qk_norm_rope kernel has no backward here)
    return LayerOps(add_rms_norm=add_rms_norm, rms_norm=rms_norm, silu_and_mul=silu_and_mul, rope=_torch_rope,
                    qkv_rope=qkv_rope, name="learner(cpu)")
