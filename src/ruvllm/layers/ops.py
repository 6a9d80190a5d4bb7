"""Fused layer ops, one implementation per device: PyTorch reference functions and Triton kernels.

`select_ops(device)` picks the set: the Triton kernels on CUDA when triton imports, the torch
reference everywhere else. The torch functions are exactly the arithmetic the Llama layer does
inline (so the CPU path is unchanged); the Triton kernels (in `triton_kernels.py`, imported only by
`triton_ops()`) compute the same in float32 and round once on store.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ruvllm.layers.rotary import RotaryEmbedding


@dataclass(frozen=True)
class LayerOps:
    """The fused ops a decoder layer calls.

    add_rms_norm(x, residual, weight, eps) -> (rms_norm(x + residual) * weight, x + residual);
        residual None: (rms_norm(x) * weight, x). x, residual: [T, H].
    rms_norm(x, weight, eps) -> y: over the last dim of [T, H] or [T, heads, D].
    silu_and_mul(gate_up) -> silu(gate_up[:, :I]) * gate_up[:, I:]: [T, 2I] -> [T, I].
    rope(q, k, cos, sin) -> (q, k): q [T, Hq, D], k [T, Hkv, D] (views allowed), cos/sin [T, 1, D]
        (neox half-split); returns new tensors.
    """

    add_rms_norm: Callable[[torch.Tensor, torch.Tensor | None, torch.Tensor, float],
                           tuple[torch.Tensor, torch.Tensor]]
    rms_norm: Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]
    silu_and_mul: Callable[[torch.Tensor], torch.Tensor]
    rope: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
    name: str = "torch"


# --- torch reference ---------------------------------------------------------------------------

def _torch_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


def _torch_add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    # `x = x + o; h = F.rms_norm(x, (H,), weight, eps)` as in the Llama layer (addition commutes
    # bitwise, so the operand order does not matter).
    new_residual = x if residual is None else residual + x
    return F.rms_norm(new_residual, (new_residual.shape[-1],), weight, eps), new_residual


def _torch_silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def _torch_rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
    return RotaryEmbedding.apply(q, k, (cos, sin))


def torch_ops() -> LayerOps:
    """The PyTorch reference ops (any device)."""
    return LayerOps(add_rms_norm=_torch_add_rms_norm, rms_norm=_torch_rms_norm,
                    silu_and_mul=_torch_silu_and_mul, rope=_torch_rope, name="torch")


def triton_ops() -> LayerOps:
    """The Triton kernels (CUDA tensors; CPU tensors only under TRITON_INTERPRET=1, set before the
    first call). Raises ImportError when triton is not installed."""
    from ruvllm.layers import triton_kernels as tk

    return LayerOps(add_rms_norm=tk.add_rms_norm, rms_norm=tk.rms_norm,
                    silu_and_mul=tk.silu_and_mul, rope=tk.rope, name="triton")


def select_ops(device: torch.device) -> LayerOps:
    """Triton kernels on a CUDA device when triton imports, else the torch reference."""
    if torch.device(device).type == "cuda":
        try:
            return triton_ops()
        except ImportError:
            pass
    return torch_ops()
