"""Causal attention for the learner's few rows as one autograd node (issue 37 item 1, session 18).

The learned layers' attention at the instant step is a dozen query rows against the prompt's kept
K/V (the frozen context) and their own: in torch a concatenation, a mask from two aranges, head
reshapes and scaled_dot_product_attention, each with its backward node. Here the forward and the
backward are one C++ call each (learning/csrc/row_attention.cpp), the softmax's probabilities kept
between them. The context's K/V take a gradient where they need one (the full context's last layer
reads the prompt's K/V of the same pass; the frozen context's were computed without the micro-LoRA).

tests/unit/test_learning_fused.py checks it against models.llama.causal_attention's autograd.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.autograd import Function


class RowAttention(Function):
    """o = attention(q, [ck; k], [cv; v]) for q [T, Hq, D], k, v [T, Hkv, D], ck, cv [C, Hkv, D] or None."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,  # type: ignore[override]
                ck: torch.Tensor | None, cv: torch.Tensor | None, scale: float, window: int, ext: Any) -> torch.Tensor:
        # (old-style, ctx first: apply binds a setup_context Function's arguments through inspect)
        o, p = ext.row_attention(q, k, v, ck, cv, scale, window)
        ctx.save_for_backward(q, k, v, ck, cv, p)
        ctx.scale, ctx.window, ctx.ext = scale, window, ext
        return o

    @staticmethod
    def backward(ctx: Any, do: torch.Tensor) -> tuple:  # type: ignore[override]
        q, k, v, ck, cv, p = ctx.saved_tensors
        dq, dk, dv, dck, dcv = ctx.ext.row_attention_grad(do.contiguous(), q, k, v, ck, cv, p, ctx.scale, ctx.window)
        needs = ctx.needs_input_grad
        return dq, dk, dv, dck if needs[3] else None, dcv if needs[4] else None, None, None, None


def row_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, window: int | None,
                  context: tuple[torch.Tensor, torch.Tensor] | None, ext: Any) -> torch.Tensor:
    """causal_attention(q, k, v, scale, window, 1, context) for one sequence, as one node. `ext`:
    cpu_build.kernels()."""
    ck, cv = (None, None) if context is None else (context[0].contiguous(), context[1].contiguous())
    return RowAttention.apply(q.contiguous(), k.contiguous(), v.contiguous(), ck, cv, scale, window or 0, ext)
