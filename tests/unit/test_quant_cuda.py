"""Packed int8/int4 weights on CUDA (PyTorch's own weight-only kernels; skipped without a GPU):
each layer == the matmul on its dequantized weight, and an int4 engine on CUDA == the CPU one."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

from ruvllm import SamplingParams  # noqa: E402
from ruvllm.config import QuantConfig  # noqa: E402
from ruvllm.quant.linear import QuantLinear  # noqa: E402
from tests.engine_fixtures import tiny_llm  # noqa: E402
from tests.unit.test_quant import assert_matches_reference, rtn  # noqa: E402


@pytest.mark.parametrize(("kind", "group_size"), [("int8", 0), ("int4", 32), ("int4", 64), ("int4", 128)])
@pytest.mark.parametrize("rows", [1, 7, 64])
def test_cuda_quant_linear_matches_dequantized_matmul(kind: str, group_size: int, rows: int) -> None:
    torch.manual_seed(1)
    n, k = 96, 384
    qw = rtn(kind, torch.randn(n, k) * 0.05, group_size)
    bias = torch.randn(n, dtype=torch.bfloat16) * 0.1
    layer = QuantLinear(qw.to("cuda"), bias.cuda())
    assert layer.packed.is_cuda
    x = torch.randn(rows, k, dtype=torch.bfloat16)
    y = layer(x.cuda())
    assert y.dtype == torch.bfloat16 and y.shape == (rows, n)
    assert_matches_reference(layer, y.cpu(), x, qw, bias)


def test_int4_engine_on_cuda_matches_the_cpu_one() -> None:
    params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0)
    prompts = [[(5 * i + j) % 500 + 2 for j in range(20 + 9 * i)] for i in range(4)]

    def prompt_logprobs(llm) -> torch.Tensor:
        outs = llm.generate(prompts, params)
        return torch.tensor([next(iter(d.values())).logprob for o in outs for d in o.prompt_logprobs[1:]])

    cuda = tiny_llm("cuda", dtype="bfloat16", quantization=QuantConfig("int4"))
    assert any(isinstance(m, QuantLinear) and m.on_cuda for m in cuda.model.modules())
    diff = (prompt_logprobs(cuda) - prompt_logprobs(tiny_llm("cpu", dtype="bfloat16", quantization=QuantConfig("int4")))).abs()
    # Same codes, different bf16 kernels. Measured on an H100: max 0.156 / mean 0.034 between the
    # two, while each is max ~1.4 / mean 0.28 from the fp32 dense model (RTN int4 error on this
    # random model): the engines agree far more closely than either matches the float model.
    assert diff.max() < 0.3 and diff.mean() < 0.04, (float(diff.max()), float(diff.mean()))
