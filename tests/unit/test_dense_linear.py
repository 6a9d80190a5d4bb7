"""Dense linear layers give each row the same bits whatever number of rows shares the call
(layers/dense.py): PyTorch's fp32 CPU matmul (MKL) takes another kernel for a few rows."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from ruvllm.layers.dense import DenseLinear, dense_linear

# The default model's projections: q/k/v, o, gate/up, down, and the (tied) LM head.
SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536), (49152, 576)]


@pytest.fixture(params=[1, 2], ids=["1-thread", "2-threads"])
def threads(request: pytest.FixtureRequest) -> Iterator[int]:
    """MKL's choice of kernel may depend on the threads too; the suite runs its workers with one
    thread each (scripts/test.sh), a server runs with all cores: both are checked here."""
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


@pytest.mark.parametrize(("out_features", "in_features"), SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_each_row_is_the_same_at_any_row_count(dtype: torch.dtype, out_features: int, in_features: int,
                                               threads: int) -> None:
    torch.manual_seed(0)
    w = torch.randn(out_features, in_features).to(dtype)
    x = torch.randn(128, in_features).to(dtype)
    together = dense_linear(x, w)
    counts = list(range(1, 41)) if out_features < 10_000 else [1, 2, 3, 5, 7, 9, 11, 13]
    for rows in counts:
        pick = torch.randperm(128)[:rows]  # rows from anywhere, in any order
        assert torch.equal(dense_linear(x[pick], w), together[pick]), rows


def test_dense_linear_module_keeps_shapes_and_bias() -> None:
    torch.manual_seed(0)
    layer = DenseLinear(64, 48, bias=True)
    assert isinstance(layer, torch.nn.Linear)  # loading and quantization treat it as any nn.Linear
    for x in (torch.randn(2, 3, 64), torch.randn(1, 64), torch.randn(20, 64)):
        torch.testing.assert_close(layer(x), torch.nn.functional.linear(x, layer.weight, layer.bias))
