"""Linear layers over packed int8/int4 weights.

int4 and int8 (per channel or in Q8_0's groups) on the CPU run our kernel (quant/cpu_matmul.py:
activations quantized to 8 bits per block of 32 as llama.cpp does, exact integer block dots), where
it builds. Elsewhere (CUDA, no compiler) PyTorch's own weight-only kernels run, which take
activations in bf16 (fed fp32 they are 15-25x slower, ../shared/notes), so the layer computes in
bf16 whatever the model's dtype and returns the model's dtype. Either way each output row is
computed the same way whatever the number of rows, so results do not depend on batch size
(tests/unit/test_quant.py checks it).
"""

from __future__ import annotations

import torch
from torch import nn

from ruvllm.quant import cpu_matmul
from ruvllm.quant.weights import KERNEL_DTYPE as COMPUTE_DTYPE
from ruvllm.quant.weights import QuantizedWeight, int8_groups_as_int4


def _inner_k_tiles(k: int) -> int:
    """The CUDA int4 layout interleaves 16 * tiles inputs; the widest tiling that divides K."""
    for tiles in (8, 4, 2):
        if k % (16 * tiles) == 0:
            return tiles
    raise ValueError(f"the CUDA int4 kernel needs the input size to be a multiple of 32, got {k}")


def quantize_rows_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """W8A8's activation quantizer, shared with the SmoothQuant error estimate (quantize/smoothquant.py)
    so both measure the same rounding: rows of x [T, K] to int8 codes, each with its own scale
    (absmax / 127, float32) [T, 1]."""
    x2 = x.float()
    scale = x2.abs().amax(dim=1, keepdim=True).clamp_min(1e-12) / 127.0
    return torch.round(x2 / scale).to(torch.int8), scale


class QuantLinear(nn.Module):
    """`int8_activations` (int8 weights only): W8A8. Each input row is quantized to int8 with its
    own scale (absmax / 127) and multiplied by the int8 weight in exact int32 arithmetic
    (`torch._int_mm`), then scaled back: rows never interact, so results are batch invariant, and
    the activations need not be bf16."""

    def __init__(self, qw: QuantizedWeight, bias: torch.Tensor | None = None, int8_activations: bool = False) -> None:
        super().__init__()
        if int8_activations and (qw.kind != "int8" or qw.group_size):
            raise ValueError("int8 activations need int8 weights with one scale per output channel")
        self.int8_activations = int8_activations
        self.kind = qw.kind
        self.out_features, self.in_features = qw.shape
        self.group_size = qw.group_size
        self.on_cuda = qw.codes.device.type == "cuda"
        # On the CPU int4 and int8 (per channel or Q8_0's groups) run our kernel: at one row it beats
        # PyTorch's int4 path on every shape of the default model, at many rows PyTorch's runs one
        # GEMV per row, and PyTorch's take bf16 activations, emulated on CPUs without native bf16
        # (docs/performance.md). W8A8 keeps its int8 x int8 matmul.
        k, group = qw.shape[1], qw.group_size or qw.shape[1]
        self.cpu_kernel = (not self.on_cuda and not int8_activations
                           and k % cpu_matmul.BLOCK == 0 and group % cpu_matmul.BLOCK == 0
                           and qw.shape[0] % cpu_matmul.TILE_ROWS == 0 and cpu_matmul.kernels() is not None)
        # Elsewhere group-wise int8 (Q8_0) runs as int4 over the input repeated twice.
        self.repeat_input = qw.kind == "int8" and qw.group_size > 0 and not self.cpu_kernel
        if self.repeat_input:
            qw = int8_groups_as_int4(qw)
        if self.cpu_kernel:
            packed = cpu_matmul.pack(qw)
            self.register_buffer("packed", packed.codes)
            self.register_buffer("scales", packed.scales)
            self.register_buffer("zeros", packed.zeros)
        elif qw.kind == "int8":
            self.register_buffer("packed", qw.codes.contiguous())
            self.register_buffer("scales", qw.scales.to(COMPUTE_DTYPE))
        elif self.on_cuda:
            # tinygemm's layout: two codes a byte, the even input in the high nibble.
            codes = qw.codes.to(torch.int32)
            pairs = ((codes[:, ::2] << 4) | codes[:, 1::2]).to(torch.uint8).contiguous()
            self.register_buffer("packed", torch.ops.aten._convert_weight_to_int4pack(
                pairs, _inner_k_tiles(qw.shape[1])))
        else:
            # inner_k_tiles is ignored by the CPU packing; 2 is a valid value for every K we take.
            self.register_buffer("packed", torch.ops.aten._convert_weight_to_int4pack_for_cpu(
                qw.codes.to(torch.int32).contiguous(), 2))
        if qw.kind == "int4" and not self.cpu_kernel:
            self.register_buffer("scales", torch.stack(
                [qw.scales.t(), qw.zeros.t()], dim=-1).to(COMPUTE_DTYPE).contiguous())  # [K/g, N, 2]
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self._kernel_weight = self._packed_record()

    def _packed_record(self) -> cpu_matmul.Packed | None:
        """Our kernel's view of the buffers, kept as a plain attribute: reading buffers goes through
        nn.Module.__getattr__ (~1 us each, five a call, ~120 calls a step)."""
        if not self.cpu_kernel:
            return None
        return cpu_matmul.Packed(self.kind == "int4", self.packed, self.scales, self.zeros,
                                 self.group_size or self.in_features)

    def _apply(self, fn, recurse=True):  # noqa: ANN001, ANN202 (nn.Module's signature)
        out = super()._apply(fn, recurse)
        self._kernel_weight = self._packed_record()  # .to() and the like replace the buffers
        return out

    def __setattr__(self, name: str, value: object) -> None:
        super().__setattr__(name, value)
        if name in ("packed", "scales", "zeros") and "_kernel_weight" in self.__dict__:
            self._kernel_weight = self._packed_record()  # a buffer replaced by assignment

    def _w8a8(self, x: torch.Tensor) -> torch.Tensor:
        xq, scale = quantize_rows_int8(x.reshape(-1, self.in_features))
        rows = xq.shape[0]
        if self.on_cuda and rows <= 16:  # the CUDA kernel wants more than 16 rows; zero rows are inert
            xq = torch.cat([xq, xq.new_zeros(17 - rows, xq.shape[1])])
        acc = torch._int_mm(xq, self.packed.t())[:rows]  # the [N, K] codes read as [K, N]: no copy
        return self._finish((acc.float() * scale * self.scales.float()).to(x.dtype), x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.int8_activations:
            return self._w8a8(x)
        x2 = x if x.dim() == 2 else x.reshape(-1, self.in_features)
        if self._kernel_weight is not None:  # takes any float dtype and returns x's
            return self._finish(cpu_matmul.matmul(x2, self._kernel_weight), x)
        # The engine calls this with [T, K] rows in bf16 already, ~120 times a step: skip every
        # conversion that would be a no-op (each costs microseconds of eager overhead).
        xq = x2 if x2.dtype == COMPUTE_DTYPE else x2.to(COMPUTE_DTYPE)
        if not xq.is_contiguous():
            xq = xq.contiguous()
        if self.repeat_input:
            xq = torch.cat([xq, xq], dim=1)
        if self.kind == "int8" and not self.repeat_input:
            y = torch.ops.aten._weight_int8pack_mm(xq, self.packed, self.scales)
        elif self.on_cuda:
            y = torch.ops.aten._weight_int4pack_mm(xq, self.packed, self.group_size, self.scales)
        else:
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(xq, self.packed, self.group_size, self.scales)
        return self._finish(y if y.dtype == x.dtype else y.to(x.dtype), x)

    def _finish(self, y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """[T, N] rows in x's dtype -> x's leading shape, plus the bias."""
        if x.dim() != 2:
            y = y.reshape(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        group = f", group_size={self.group_size}" if self.group_size else ""
        kind = "w8a8" if self.int8_activations else self.kind
        return f"{kind}, in_features={self.in_features}, out_features={self.out_features}{group}"
