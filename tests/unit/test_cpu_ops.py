"""Our C++ kernels as PyTorch operators (csrc/ops.cpp): each one's fake kernel, which tracing
(torch.compile, FakeTensorMode) runs instead of the kernel, gives the real kernel's shapes and dtypes."""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from ruvllm.cpu_build import kernels
from ruvllm.quant import cpu_matmul
from ruvllm.quant.rtn import quantize_int4
from tests.unit.paged_reference import BLOCK, random_step

ops = kernels()
pytestmark = pytest.mark.skipif(ops is None, reason="no C++ compiler: the kernels cannot be built")


def _calls() -> dict[str, tuple]:
    q, kc, vc, tables, row_seq, row_ctx = random_step(torch.bfloat16, 9, 3)
    packed = cpu_matmul.pack(quantize_int4(torch.randn(48, 64) * 0.05, 32))
    x = torch.randn(5, 64)
    return {"paged_attention": (q, kc, vc, tables, row_seq, row_ctx, BLOCK, 0.125),
            "dense_matmul": (x, torch.randn(40, 64)),
            "quant_matmul": (x, packed.codes, packed.scales, packed.zeros, packed.group, True)}


@pytest.mark.parametrize("op", ["paged_attention", "dense_matmul", "quant_matmul"])
def test_fake_kernels_give_the_real_shapes(op: str) -> None:
    args = _calls()[op]
    real = getattr(ops, op)(*args)
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fake_args = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args]
        fake = getattr(ops, op)(*fake_args)
    assert (fake.shape, fake.dtype) == (real.shape, real.dtype)
