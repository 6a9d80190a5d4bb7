"""Fused layer ops, one implementation per device: PyTorch reference functions, our C++ CPU
kernels and Triton kernels.

`select_ops(device)` picks the set: the Triton kernels on CUDA when triton imports, our C++ kernels
(`csrc/fused_ops.cpp`, one call per op where eager PyTorch makes several) on the CPU where they
build, the torch reference elsewhere. The torch functions are the plain PyTorch arithmetic; the
C++ and Triton kernels compute the same in float32 and round once on store.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

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
    qkv_rope(qkv, cos, sin, Hq, Hkv, D) -> (q, k, v): the fused projection's output [T, (Hq + 2Hkv)D]
        split into heads, rope on q and k; contiguous new tensors.
    qk_norm_rope(qkv, q_weight, k_weight, eps, cos, sin, Hq, Hkv, D) -> (q, k, v): qkv_rope with each
        q and k head RMS-normed before its rotation (Qwen3, Gemma 3), in one kernel; None where the set
        has none (the layer then calls rms_norm and rope).
    """

    add_rms_norm: Callable[[torch.Tensor, torch.Tensor | None, torch.Tensor, float],
                           tuple[torch.Tensor, torch.Tensor]]
    rms_norm: Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]
    silu_and_mul: Callable[[torch.Tensor], torch.Tensor]
    rope: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
    qkv_rope: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, int, int, int],
                       tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
    name: str = "torch"
    qk_norm_rope: Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]] | None = None


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


def _split_then_rope(rope: Callable) -> Callable:
    """qkv_rope from a rope op: split and view the heads, rotate q and k, copy v contiguous."""
    def qkv_rope(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_heads: int, num_kv_heads: int,
                 head_dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
        q, k = rope(q.view(-1, num_heads, head_dim), k.view(-1, num_kv_heads, head_dim), cos, sin)
        return q, k, v.reshape(-1, num_kv_heads, head_dim).contiguous()
    return qkv_rope


_torch_qkv_rope = _split_then_rope(_torch_rope)


def torch_ops() -> LayerOps:
    """The PyTorch reference ops (any device)."""
    return LayerOps(add_rms_norm=_torch_add_rms_norm, rms_norm=_torch_rms_norm,
                    silu_and_mul=_torch_silu_and_mul, rope=_torch_rope, qkv_rope=_torch_qkv_rope, name="torch")


def cpu_ops(kernels: Any) -> LayerOps:
    """Our C++ kernels (`kernels`: cpu_build.kernels()) for contiguous CPU rows; RoPE on separate q
    and k stays the torch op (q/k norms and RoPE run fused in qk_norm_rope)."""
    def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            return kernels.rms_norm(x, weight, eps), x
        return kernels.add_rms_norm(x, residual, weight, eps)

    def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        if x.dim() != 2 or not x.is_contiguous():  # q/k norms over heads: [T, heads, D] views
            return _torch_rms_norm(x, weight, eps)
        return kernels.rms_norm(x, weight, eps)

    def qk_norm_rope(qkv: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, eps: float,
                     cos: torch.Tensor, sin: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        # The kernel the C++ layer loop calls (qkv_rope_cache with the norms), so the two loops
        # stay bitwise equal; aten::rms_norm on the heads' views was ~7% of a Gemma 3 step.
        return kernels.qkv_rope(qkv, cos, sin, num_heads, num_kv_heads, head_dim, q_weight, k_weight, eps)

    return LayerOps(add_rms_norm=add_rms_norm, rms_norm=rms_norm, silu_and_mul=kernels.silu_and_mul,
                    rope=_torch_rope, qkv_rope=kernels.qkv_rope, name="cpu", qk_norm_rope=qk_norm_rope)


def triton_ops() -> LayerOps:
    """The Triton kernels (CUDA tensors; CPU tensors only under TRITON_INTERPRET=1, set before the
    first call). Raises ImportError when triton is not installed."""
    from ruvllm.layers import triton_kernels as tk

    return LayerOps(add_rms_norm=tk.add_rms_norm, rms_norm=tk.rms_norm, silu_and_mul=tk.silu_and_mul,
                    rope=tk.rope, qkv_rope=_split_then_rope(tk.rope), name="triton")


def select_ops(device: torch.device) -> LayerOps:
    """Triton kernels on a CUDA device when triton imports; our C++ kernels on the CPU where they
    build; else the torch reference."""
    if torch.device(device).type == "cuda":
        try:
            return triton_ops()
        except ImportError:
            return torch_ops()
    if torch.device(device).type != "cpu":
        return torch_ops()
    from ruvllm.cpu_build import kernels

    ext = kernels()
    return torch_ops() if ext is None else cpu_ops(ext)
