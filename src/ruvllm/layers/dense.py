"""Dense linear layers whose output rows do not depend on how many rows came with them.

A request's logits must not depend on what shared its step (docs/architecture.md). PyTorch's fp32
matmul on CPU is MKL's sgemm, and MKL picks a different kernel for a few rows than for many: on an
AVX2 CPU (MKL 2024.2, 1 or 2 threads) a row computed in a call of 1-3, 5-7 or 9-11 rows differs in
the last bits from the same row computed in a call of 4, 8, or 12 and more rows (measured on every
projection shape of the default model, rows at any position). So a decode alone (one row) and the
same decode beside others disagreed, and fp32 logprobs were not batch invariant.

fp32 on the CPU therefore runs our own kernel (layers/csrc/dense_matmul.cpp), which computes every
output as the same dot product at any row count. Against MKL on the default model's shapes
(`benchmarks/quant_matmul.py`, the fp32 columns; docs/benchmarks.md) it is about as fast as MKL's
one-row GEMV (2-2.7x faster on the LM head), 1.4-4.9x faster than the padded call at 4-16 rows, and
0.76-1.30x MKL's time at 64-512 rows (prompt chunks; up to 1.73x before session 25 held its operands
in registers). Where the C++ kernels cannot be built or the CPU lacks AVX2 (where the kernel would be a
plain loop), calls below 16 rows are padded with zero
rows to 16, which takes MKL's many-rows kernel; rows never interact, so the padding changes no
real row. (On AVX2 MKL takes it from 4 rows; on an AVX-512 Xeon from 16.) That holds on one thread;
with more, MKL splits some shapes' calls between threads by their row count (576 x 1536 on the
Xeon, 2 threads: calls of 57-81 rows differ from 256), which no padding short of a fixed size
avoids, so the fallback is batch invariant on one thread only. tests/unit/test_dense_linear.py
checks both on this machine.

bf16 and fp16 go through oneDNN, whose rows are the same at every count measured once its AMX
kernels are left out (ruvllm/__init__.py caps its ISA); CUDA makes no bit-exact claim (docs/gpu.md). Both are left as they are. A call that autograd records (training
through a layer) takes F.linear: the kernel has no backward.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from ruvllm.cpu_build import kernels


@functools.cache
def _simd() -> bool:
    """Whether our kernel is its vectorized self here: it is built for the machine's CPU, and
    without AVX2 it is a plain loop, slower than the BLAS it would replace."""
    return torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")


# Calls with at least this many rows, or a multiple of ROW_MULTIPLE, take MKL's many-rows kernel.
MANY_ROWS = 16
ROW_MULTIPLE = 16


def dense_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias), each output row the same whatever the number of rows in x."""
    if x.dtype != torch.float32 or x.device.type != "cpu" or weight.dtype != torch.float32:
        return F.linear(x, weight, bias)
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        return F.linear(x, weight, bias)
    k = x.shape[-1]
    if k == 0 or (bias is not None and bias.dtype != torch.float32):
        return F.linear(x, weight, bias)  # nothing to multiply, or a bias F.linear refuses
    ops = kernels() if _simd() else None
    if ops is None:
        return padded_linear(x, weight, bias)
    y = ops.dense_matmul(x.reshape(-1, k).contiguous(), weight.contiguous())
    if bias is not None:
        y.add_(bias)
    return y.reshape(*x.shape[:-1], weight.shape[0])


def padded_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The fallback without our kernels: MKL's matmul, calls of a few rows padded to its many-rows kernel."""
    k = x.shape[-1]
    rows = x.numel() // k if k else 0
    if rows >= MANY_ROWS or rows % ROW_MULTIPLE == 0:
        return F.linear(x, weight, bias)
    flat = x.reshape(rows, k)
    padded = torch.cat([flat, flat.new_zeros(-rows % ROW_MULTIPLE, k)])
    return F.linear(padded, weight, bias)[:rows].reshape(*x.shape[:-1], weight.shape[0])


class DenseLinear(nn.Linear):
    """nn.Linear computed by dense_linear (same parameters, same state dict)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return dense_linear(x, self.weight, self.bias)
