"""The sampled softmax's drawn candidates as one pooled logit (issue 37 item 1, session 19).

The instant step's losses (cross-entropy toward the target, unlikelihood away from it) read the
logits of the drawn candidates only through the softmax's normalizer: every target token is an
exact candidate. So the drawn columns, rows D^T + bias, can be replaced by one column holding their
log-sum-exp, lse_t: the softmax over [exact logits, lse] gives each exact candidate the probability
the softmax over all the columns gives it, and the losses are the same (in another float order).
Its gradient is d lse_t / d r_t = sum_j softmax_j D_j, which learning/csrc/sampled_logits.cpp sums in
the same pass as the logits: the drawn block (2,048 head rows, 4.7 MB, gathered ahead and cold by
the time of the step) is read once a step, not twice (forward and backward products), and no
[T, 2048] logits are made (docs/learning.md "Session 19").
"""

from __future__ import annotations

from typing import Any

import torch
from torch.autograd import Function


class DrawnPool(Function):
    """lse_t = log sum_j exp(rows_t . drawn_j + bias_j) over the unmasked j, differentiable in rows."""

    @staticmethod
    def forward(ctx: Any, rows: torch.Tensor, drawn: torch.Tensor, bias: torch.Tensor,  # type: ignore[override]
                masked: torch.Tensor, ext: Any) -> torch.Tensor:
        # (old-style, ctx first: apply binds a setup_context Function's arguments through inspect)
        lse, ctx.pooled = ext.drawn_pool(rows, drawn, bias, masked)
        return lse

    @staticmethod
    def backward(ctx: Any, dlse: torch.Tensor) -> tuple:  # type: ignore[override]
        return dlse[:, None] * ctx.pooled, None, None, None, None


def sampled_logits(rows: torch.Tensor, exact: torch.Tensor, drawn: torch.Tensor, bias: float,
                   masked: torch.Tensor, ext: Any | None) -> torch.Tensor:
    """Logits [T, m + 1]: rows against the exact candidates' head rows `exact` [m, H], then the drawn
    ones' `drawn` [n, H] (each logit raised by `bias`; `masked` [n] bool: left out) pooled into one
    column, their log-sum-exp. Our C++ where `ext` (cpu_build.kernels()) is given and the width is a
    multiple of 8, else torch's products and logsumexp (the same value)."""
    if ext is None or rows.shape[-1] % 8 or rows.dtype != torch.float32:
        drawn_logits = (rows @ drawn.t() + bias).masked_fill(masked, float("-inf"))
        lse = drawn_logits.logsumexp(dim=1)
    else:
        lse = DrawnPool.apply(rows.contiguous(), drawn.contiguous(), torch.full((len(drawn),), bias),
                              masked.contiguous(), ext)
    return torch.cat([rows @ exact.t(), lse[:, None]], dim=1)
