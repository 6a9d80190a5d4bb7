"""Dense linear layers give each row the same bits whatever number of rows shares the call
(layers/dense.py): our fp32 kernel, and MKL padded to its many-rows kernel where ours is absent."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
import torch
import torch.nn.functional as F

from ruvllm.cpu_build import kernels
from ruvllm.layers.dense import DenseLinear, dense_linear, padded_linear

# The default model's projections: q/k/v, o, gate/up, down, and the (tied) LM head; then odd sizes
# (K not a multiple of 8, N not a multiple of the kernel's tile).
SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536), (49152, 576), (37, 13), (5, 100)]
IMPLS = {"ours": dense_linear, "padded-mkl": padded_linear}


@pytest.fixture(params=[1, 2], ids=["1-thread", "2-threads"])
def threads(request: pytest.FixtureRequest) -> Iterator[int]:
    """MKL's choice of kernel may depend on the threads too; the suite runs its workers with one
    thread each (scripts/test.sh), a server runs with all cores: both are checked here."""
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def operands() -> Callable[[torch.dtype, int, int], tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """x [128, K], w [N, K] and their float64 product, made once per dtype and shape for the module:
    each is checked with up to three implementation/thread settings, and drawing the LM head's 28M
    weights and its float64 product took ~0.8 s of CPU each time."""
    made: dict[tuple[torch.dtype, int, int], tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}

    def get(dtype: torch.dtype, out_features: int, in_features: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        key = (dtype, out_features, in_features)
        if key not in made:
            torch.manual_seed(0)
            w = torch.randn(out_features, in_features).to(dtype)
            x = torch.randn(128, in_features).to(dtype)
            made[key] = x, w, F.linear(x.double(), w.double())
        return made[key]

    return get


# Our kernel's row paths (dense_matmul.cpp): micro-kernels of MR = 4 input rows, then 1-3 rows left,
# in blocks of MB = 64 rows. 1-12 is each remainder with 0, 1 and 2 full micro-kernels, then counts
# around 32 and the block's end: every path that 1-40 took, at half the calls. MKL's kernel choice
# is not ours to read, so the padded fallback keeps every count from 1 to 40.
OUR_COUNTS = list(range(1, 13)) + [31, 32, 33, 40, 63, 64, 65, 127]
MKL_COUNTS = list(range(1, 41)) + [64, 65, 127]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize(("out_features", "in_features"), SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_each_row_is_the_same_at_any_row_count(dtype: torch.dtype, out_features: int, in_features: int,
                                               impl: str, threads: int, operands) -> None:  # noqa: ANN001
    if impl == "ours" and kernels() is None:
        pytest.skip("the C++ kernels could not be built here")
    if impl == "padded-mkl" and dtype != torch.float32:
        pytest.skip("only float32 is padded")
    if impl == "padded-mkl" and threads > 1:
        pytest.skip("the fallback is batch invariant on one thread only (layers/dense.py says why)")
    linear: Callable[..., torch.Tensor] = IMPLS[impl]
    x, w, exact = operands(dtype, out_features, in_features)
    together = linear(x, w)
    tol = dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=2e-2, atol=0.5)
    torch.testing.assert_close(together.double(), exact, **tol)
    counts = (OUR_COUNTS if impl == "ours" else MKL_COUNTS) if out_features < 10_000 else [1, 2, 3, 5, 7, 9, 11, 13, 65]
    torch.manual_seed(1)  # which rows: the same whichever test drew the operands
    for rows in counts:
        pick = torch.randperm(128)[:rows]  # rows from anywhere, in any order
        assert torch.equal(linear(x[pick], w), together[pick]), rows


def test_float32_on_the_cpu_runs_our_kernel() -> None:
    ops = kernels()
    if ops is None:
        pytest.skip("the C++ kernels could not be built here")
    torch.manual_seed(0)
    x, w, b = torch.randn(2, 3, 64), torch.randn(48, 64), torch.randn(48)
    assert torch.equal(dense_linear(x, w, b), (ops.dense_matmul(x.reshape(6, 64), w) + b).reshape(2, 3, 48))
    # strided input, no rows
    xt = torch.randn(64, 5).t()
    assert torch.equal(dense_linear(xt, w), ops.dense_matmul(xt.contiguous(), w))
    assert dense_linear(torch.randn(0, 64), w).shape == (0, 48)
    assert torch.equal(dense_linear(torch.randn(3, 0), torch.randn(5, 0)), torch.zeros(3, 5))  # K = 0, as F.linear
    # recorded by autograd: F.linear, which has a backward
    xg = torch.randn(3, 64, requires_grad=True)
    dense_linear(xg, w).sum().backward()
    torch.testing.assert_close(xg.grad, w.sum(0).expand(3, 64))


def test_dense_linear_module_keeps_shapes_and_bias() -> None:
    torch.manual_seed(0)
    layer = DenseLinear(64, 48, bias=True)
    assert isinstance(layer, torch.nn.Linear)  # loading and quantization treat it as any nn.Linear
    with torch.no_grad():
        for x in (torch.randn(2, 3, 64), torch.randn(1, 64), torch.randn(20, 64)):
            torch.testing.assert_close(layer(x), torch.nn.functional.linear(x, layer.weight, layer.bias))
