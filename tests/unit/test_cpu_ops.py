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
from tests.unit.test_llama_layers import one_layer_call

ops = kernels()
pytestmark = pytest.mark.skipif(ops is None, reason="no C++ compiler: the kernels cannot be built")


def _calls() -> dict[str, tuple]:
    q, kc, vc, tables, row_seq, row_ctx = random_step(torch.bfloat16, 9, 3)
    packed = cpu_matmul.pack(quantize_int4(torch.randn(48, 64) * 0.05, 32))
    x = torch.randn(5, 64)
    return {"paged_attention": (q, kc, vc, tables, row_seq, row_ctx, BLOCK, 0.125),
            "dense_matmul": (x, torch.randn(40, 64)),
            "quant_matmul": (x, packed.codes, packed.scales, packed.zeros, packed.group, True),
            "rms_norm": (x, torch.randn(64), 1e-5),
            "add_rms_norm": (x, torch.randn(5, 64), torch.randn(64), 1e-5),
            "qkv_rope": (torch.randn(5, 15 * 16), torch.randn(5, 1, 16), torch.randn(5, 1, 16), 9, 3, 16),
            "silu_and_mul": (torch.randn(5, 2 * 48),),
            "qkv_rope_cache": (torch.randn(5, 15 * 16), torch.randn(5, 1, 16), torch.randn(5, 1, 16), 9, 3, 16,
                               torch.zeros(32, 3, 16), torch.zeros(32, 3, 16), torch.arange(5) + 7),
            "llama_layers": one_layer_call()}


@pytest.mark.parametrize("op", list(_calls()))
def test_fake_kernels_give_the_real_shapes(op: str) -> None:
    args = _calls()[op]
    real = getattr(ops, op)(*args)
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fake_args = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args]
        fake = getattr(ops, op)(*fake_args)
    real, fake = (real,) if isinstance(real, torch.Tensor) else real, (fake,) if isinstance(fake, torch.Tensor) else fake
    assert [(f.shape, f.dtype) for f in fake] == [(r.shape, r.dtype) for r in real]
