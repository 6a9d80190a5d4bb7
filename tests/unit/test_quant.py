"""Quantized weights: RTN int8/int4 round trips, QuantLinear against a float reference and across batch
sizes, GGUF blocks against gguf's own dequantizer, fusing rows, the per-weight plan, and bad settings."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as QType
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize

from ruvllm.config import QUANTIZATION_METHODS, QuantConfig
from ruvllm.dtypes import resolve_model_dtype
from ruvllm.engine.llm import build_engine_config
from ruvllm.quant import cpu_matmul
from ruvllm.quant.gguf_blocks import gguf_int4, gguf_int8, gguf_quantized
from ruvllm.quant.linear import QuantLinear
from ruvllm.quant.plan import final_form, fuse_pieces, quantizes_weights
from ruvllm.quant.rtn import quantize_int4, quantize_int8
from ruvllm.quant.weights import QuantizedWeight, concat_rows
from tests.unit.quant_reference import eight_bit_block_reference

# Block sizes, to check that the fixtures have the [rows, bytes per row] layout GGUFReader gives.
BLOCK_BYTES = {QType.Q4_0: 18, QType.Q4_1: 20, QType.Q8_0: 34, QType.Q4_K: 144}
BLOCK_WEIGHTS = {QType.Q4_0: 32, QType.Q4_1: 32, QType.Q8_0: 32, QType.Q4_K: 256}


def rtn(kind: str, w: torch.Tensor, group_size: int = 32) -> QuantizedWeight:
    return quantize_int8(w) if kind == "int8" else quantize_int4(w, group_size)


def bf16_scaled(qw: QuantizedWeight) -> QuantizedWeight:
    """The weight QuantLinear actually computes with: it reads scales and zeros in bf16."""
    return QuantizedWeight(qw.kind, qw.codes, qw.scales.bfloat16().float(),
                           None if qw.zeros is None else qw.zeros.bfloat16().float(), qw.group_size)


def half_step_excess(qw: QuantizedWeight, w: torch.Tensor) -> torch.Tensor:
    """Per row (int8) or group (int4): max |dequantized - w| / (scale / 2). At most 1 for round-to-nearest."""
    err = (qw.dequantize() - w.float()).abs()
    n, k = w.shape
    if qw.group_size:
        err = err.reshape(n, k // qw.group_size, qw.group_size)
    return err.amax(dim=-1) / (qw.scales / 2)


def q4k_raw(rng: np.random.Generator, n: int, k: int) -> np.ndarray:
    """Q4_K rows as GGUFReader hands them; gguf cannot quantize Q4_K, so random bytes stand in for
    codes and 6-bit sub-scales, with d and dmin made sane f16 values (random bytes can be inf/nan)."""
    raw = rng.integers(0, 256, size=(n, k // 256 * 144), dtype=np.uint8)
    blocks = raw.reshape(-1, 144)
    for col in (0, 2):  # d, dmin
        vals = rng.uniform(0.001, 0.011, size=blocks.shape[0]).astype(np.float16)
        blocks[:, col:col + 2] = vals.view(np.uint8).reshape(-1, 2)
    return raw


def gguf_weight(rng: np.random.Generator, qtype: QType, n: int, k: int) -> tuple[np.ndarray, np.ndarray]:
    """(raw blocks, gguf's dequantization of them)."""
    if qtype == QType.Q4_K:
        raw = q4k_raw(rng, n, k)
    else:
        w = (rng.standard_normal((n, k)) * 0.05).astype(np.float32)
        w[::3] += 0.2  # rows off zero, so Q4_1's min and the zero points matter
        raw = gguf_quantize(w, qtype)
    return raw, gguf_dequantize(raw, qtype)


# ---------------------------------------------------------------------------------------------
# round-to-nearest quantizers


@pytest.mark.parametrize("shape", [(16, 256), (7, 512), (33, 64)])
def test_int8_round_trip_within_half_step(shape) -> None:
    torch.manual_seed(0)
    w = torch.randn(shape) * torch.rand(shape[0], 1) * 3  # rows of different ranges
    qw = quantize_int8(w)
    assert (qw.kind, qw.group_size, qw.zeros) == ("int8", 0, None)
    assert qw.codes.dtype == torch.int8 and qw.codes.shape == shape
    assert qw.scales.dtype == torch.float32 and qw.scales.shape == (shape[0],)
    assert int(qw.codes.min()) >= -127 and int(qw.codes.max()) <= 127
    assert torch.equal(qw.scales.bfloat16().float(), qw.scales)  # the kernel reads them in bf16
    assert float(half_step_excess(qw, w).max()) <= 1 + 1e-5
    # each row's largest weight maps to +-127: the range is used in full
    assert torch.equal(qw.codes.abs().amax(dim=1), torch.full((shape[0],), 127, dtype=torch.int8))


@pytest.mark.parametrize("group_size", [32, 64, 128, 256])
def test_int4_round_trip_within_half_step(group_size) -> None:
    torch.manual_seed(group_size)
    w = torch.randn(24, 512) * torch.rand(24, 1) * 2
    qw = quantize_int4(w, group_size)
    assert (qw.kind, qw.group_size) == ("int4", group_size)
    assert qw.codes.dtype == torch.uint8 and qw.codes.shape == (24, 512)
    assert qw.scales.shape == qw.zeros.shape == (24, 512 // group_size)
    assert int(qw.codes.min()) >= 0 and int(qw.codes.max()) <= 15
    assert torch.equal(qw.scales.bfloat16().float(), qw.scales)
    assert torch.equal(qw.zeros.bfloat16().float(), qw.zeros)
    assert float(half_step_excess(qw, w).max()) <= 1 + 1e-5
    # min and max of each group land on the end codes 0 and 15
    groups = qw.codes.reshape(24, -1, group_size)
    assert torch.all(groups.amin(dim=-1) == 0) and torch.all(groups.amax(dim=-1) == 15)


def test_quantizers_handle_zero_rows() -> None:
    w = torch.zeros(4, 64)
    w[1] = torch.randn(64)
    for qw in (quantize_int8(w), quantize_int4(w, 32)):
        out = qw.dequantize()
        assert torch.isfinite(out).all()
        assert torch.equal(out[0], torch.zeros(64))


@pytest.mark.parametrize(("offset", "spread"), [(10.0, 0.01), (0.3, 0.0)])
def test_int4_round_trip_within_half_step_for_offset_groups(offset, spread) -> None:
    # Groups far from zero relative to their spread: the zero point's bf16 rounding must not push
    # weights off the grid.
    torch.manual_seed(0)
    w = offset + spread * torch.randn(4, 64)
    assert float(half_step_excess(quantize_int4(w, 32), w).max()) <= 1 + 1e-5


# ---------------------------------------------------------------------------------------------
# QuantLinear


def assert_matches_reference(layer: QuantLinear, y: torch.Tensor, x: torch.Tensor, qw: QuantizedWeight,
                             bias: torch.Tensor | None) -> None:
    """y against what the layer's kernel is defined to compute, with S = sum |x| |w| per output.
    Our CPU kernel (int4 on the CPU): 8-bit block activations, float16 scales, float32 accumulation
    (tests/unit/quant_reference.py), within 2e-4 S: an activation at a tie of x / scale may take
    either code (the kernel multiplies by a float32 reciprocal), one code step being ~6e-5 S here.
    PyTorch's kernels: a float32 matmul of bf16-rounded activations with bf16-rounded scales, within
    one bf16 ulp of S (+|b|), the kernel's result being rounded to bf16. A bf16 output adds its own
    rounding in both cases."""
    x2 = x.reshape(-1, x.shape[-1]).float()
    b = None if bias is None else bias.float()
    if layer.cpu_kernel:
        product = eight_bit_block_reference(x2, qw).float()
        ref = product + (0 if b is None else b)
        # bf16 rounds the product (half an ulp: at most 2^-8 |product|), then the sum with the bias
        rounded = 2 * product.abs() + (0 if b is None else b.abs())
        tol = 2e-4 * F.linear(x2.abs(), qw.dequantize().abs()) + 2 ** -8 * rounded * (y.dtype != torch.float32)
    else:
        xr = x2.bfloat16().float()
        wr = bf16_scaled(qw).dequantize()
        ref = F.linear(xr, wr, b)
        tol = 2 ** -8 * F.linear(xr.abs(), wr.abs(), None if b is None else b.abs())
    err = (y.float().reshape(ref.shape) - ref).abs()
    assert torch.all(err <= tol + 1e-6), float((err / (tol + 1e-6)).max())


@pytest.fixture(params=["ours", "torch"])
def int4_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """int4 and int8 on the CPU through our kernel where it builds, and through PyTorch's (as where it does not)."""
    if request.param == "torch":
        monkeypatch.setattr(cpu_matmul, "kernels", lambda: None)
    elif cpu_matmul.kernels() is None:
        pytest.skip("the C++ kernels could not be built here")
    return request.param


def test_kernel_record_follows_replaced_buffers() -> None:
    """QuantLinear keeps our kernel's view of its buffers as a plain attribute (for speed); moving
    the module or assigning a buffer must refresh it, never leave it reading the old tensors."""
    if cpu_matmul.kernels() is None:
        pytest.skip("the C++ kernels could not be built here")
    torch.manual_seed(8)
    layer = QuantLinear(rtn("int4", torch.randn(64, 128) * 0.05, 32))
    x = torch.randn(3, 128)
    y = layer(x)
    layer.to(torch.bfloat16)  # a dtype cast leaves the packed buffers (float16 bits as int16) alone
    assert torch.equal(layer(x), y)
    double = (layer.scales.view(torch.float16) * 2).view(torch.int16)  # every scale doubled
    layer.scales = double
    assert layer._kernel_weight.scales is layer.scales
    layer.zeros = (layer.zeros.view(torch.float16) * 2).view(torch.int16)
    assert torch.allclose(layer(x), 2 * y, rtol=1e-5, atol=1e-5)  # outputs double


def test_int4_on_the_cpu_runs_our_kernel() -> None:
    torch.manual_seed(7)
    qw = rtn("int4", torch.randn(64, 128) * 0.05, 32)
    layer = QuantLinear(qw)
    assert layer.cpu_kernel == (cpu_matmul.kernels() is not None)
    assert QuantLinear(rtn("int8", torch.randn(64, 128) * 0.05)).cpu_kernel == layer.cpu_kernel  # per channel too
    # and its 8-bit activations stay close to the float matmul it stands for (1% of sum |x| |w|)
    x = torch.randn(9, 128)
    exact = F.linear(x, qw.dequantize())
    assert torch.all((layer(x) - exact).abs() <= 0.01 * F.linear(x.abs(), qw.dequantize().abs()))


@pytest.mark.parametrize(("kind", "group_size"), [("int8", 0), ("int4", 32), ("int4", 64), ("int4", 128)])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_quant_linear_matches_dequantized_matmul(kind, group_size, with_bias, dtype, int4_path) -> None:
    torch.manual_seed(1)
    n, k = 96, 384
    qw = rtn(kind, torch.randn(n, k) * 0.05, group_size)
    bias = (torch.randn(n) * 0.1).to(dtype) if with_bias else None  # the model holds biases in its dtype
    layer = QuantLinear(qw, bias)
    x = torch.randn(2, 5, k).to(dtype)
    y = layer(x)
    assert y.dtype == dtype
    assert y.shape == (2, 5, n)
    # rtn's scales are bf16 already, so the layer computes with exactly qw.dequantize()
    assert torch.equal(bf16_scaled(qw).dequantize(), qw.dequantize())
    assert_matches_reference(layer, y, x, qw, bias)
    # leading dimensions are only a view: the same rows flattened give the same bits
    assert torch.equal(layer(x.reshape(10, k)).reshape(2, 5, n), y)


@pytest.mark.parametrize("qtype", [QType.Q4_0, QType.Q4_1, QType.Q4_K], ids=lambda q: q.name)
def test_quant_linear_on_gguf_int4_blocks(qtype) -> None:
    rng = np.random.default_rng(2)
    n, k = 64, 512
    raw, _ = gguf_weight(rng, qtype, n, k)
    qw = gguf_int4(raw, qtype, (n, k))
    x = torch.from_numpy(rng.standard_normal((7, k)).astype(np.float32))
    layer = QuantLinear(qw)
    y = layer(x)
    assert y.dtype == torch.float32 and y.shape == (7, n)
    # f16 scales (and f32 zeros) are rounded as the layer holds them: the reference rounds them too
    assert_matches_reference(layer, y, x, qw, None)


def test_quant_linear_refuses_group_wise_int8_for_w8a8() -> None:
    # group-wise int8 itself runs (tests/unit/test_q8_q4k.py); int8 x int8 needs per-channel scales
    rng = np.random.default_rng(3)
    raw, _ = gguf_weight(rng, QType.Q8_0, 16, 64)
    with pytest.raises(ValueError, match="per output channel"):
        QuantLinear(gguf_int8(raw, (16, 64)), int8_activations=True)


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_quant_linear_takes_non_contiguous_input(kind) -> None:
    torch.manual_seed(6)
    layer = QuantLinear(rtn(kind, torch.randn(64, 128) * 0.05))
    x = torch.randn(128, 5).t()
    assert torch.equal(layer(x), layer(x.contiguous()))


@pytest.mark.parametrize(("kind", "group_size"), [("int8", 0), ("int4", 32), ("int4", 128)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_quant_linear_is_batch_invariant(kind, group_size, dtype, int4_path) -> None:
    # A request's logits must not depend on how many other rows share its step.
    torch.manual_seed(4)
    n, k = 80, 256
    layer = QuantLinear(rtn(kind, torch.randn(n, k) * 0.05, group_size))
    x = torch.randn(64, k).to(dtype)
    full = layer(x)
    for m in range(1, 41):
        assert torch.equal(layer(x[:m]), full[:m]), f"rows differ when run {m} at a time"
    assert torch.equal(layer(x[17:18]), full[17:18])  # a row not at the start too


@pytest.mark.parametrize(("kind", "group_size"), [("int8", 0), ("int4", 32), ("int4", 128)])
def test_fused_quant_linear_equals_its_parts(kind, group_size) -> None:
    # The model fuses q/k/v and gate/up; fusing must not change any output column.
    torch.manual_seed(5)
    parts = [rtn(kind, torch.randn(rows, 256) * 0.05, group_size) for rows in (64, 32, 32)]
    x = torch.randn(5, 256).bfloat16()
    fused = QuantLinear(concat_rows(parts))(x)
    assert torch.equal(fused, torch.cat([QuantLinear(p)(x) for p in parts], dim=-1))


# ---------------------------------------------------------------------------------------------
# GGUF blocks


@pytest.mark.parametrize("qtype", [QType.Q4_0, QType.Q4_1], ids=lambda q: q.name)
def test_gguf_q4_0_q4_1_decode_exactly(qtype) -> None:
    rng = np.random.default_rng(6)
    n, k = 12, 256
    raw, ref = gguf_weight(rng, qtype, n, k)
    for qw in (gguf_int4(raw, qtype, (n, k)), gguf_quantized(raw, qtype, (n, k))):
        assert (qw.kind, qw.group_size, qw.shape) == ("int4", 32, (n, k))
        assert qw.codes.dtype == torch.uint8 and int(qw.codes.max()) <= 15
        assert qw.scales.dtype == qw.zeros.dtype == torch.float32
        assert qw.scales.shape == qw.zeros.shape == (n, k // 32)
        assert np.array_equal(qw.dequantize().numpy(), ref)


def test_gguf_q4_k_decodes_to_gguf_values() -> None:
    rng = np.random.default_rng(7)
    n, k = 6, 768
    raw, ref = gguf_weight(rng, QType.Q4_K, n, k)
    qw = gguf_quantized(raw, QType.Q4_K, (n, k))
    assert (qw.kind, qw.group_size, qw.shape) == ("int4", 32, (n, k))
    assert int(qw.codes.max()) <= 15
    # zero = 8 d sc - dmin m is one extra f32 rounding compared with gguf's d sc q - dmin m
    np.testing.assert_allclose(qw.dequantize().numpy(), ref, rtol=1e-5, atol=1e-6)


def test_gguf_q8_0_decodes_exactly() -> None:
    rng = np.random.default_rng(8)
    n, k = 10, 320
    raw, ref = gguf_weight(rng, QType.Q8_0, n, k)
    for qw in (gguf_int8(raw, (n, k)), gguf_quantized(raw, QType.Q8_0, (n, k))):
        assert (qw.kind, qw.group_size, qw.shape, qw.zeros) == ("int8", 32, (n, k), None)
        assert qw.codes.dtype == torch.int8 and qw.scales.shape == (n, k // 32)
        assert np.array_equal(qw.dequantize().numpy(), ref)


@pytest.mark.parametrize("qtype", [QType.Q4_0, QType.Q4_1, QType.Q4_K, QType.Q8_0], ids=lambda q: q.name)
def test_gguf_wrong_byte_count_raises(qtype) -> None:
    # The loader turns this ValueError into CorruptModelError; anything else would escape as a crash.
    rng = np.random.default_rng(9)
    n, k = 4, 512
    raw, _ = gguf_weight(rng, qtype, n, k)
    assert raw.shape == (n, k // BLOCK_WEIGHTS[qtype] * BLOCK_BYTES[qtype])
    with pytest.raises(ValueError):
        gguf_quantized(raw[:, :-1], qtype, (n, k))
    with pytest.raises(ValueError):
        gguf_quantized(raw, qtype, (n + 1, k))


def test_gguf_int4_refuses_other_types() -> None:
    raw = np.zeros((2, 68), dtype=np.uint8)
    with pytest.raises(ValueError, match="Q8_0"):
        gguf_int4(raw, QType.Q8_0, (2, 64))


# ---------------------------------------------------------------------------------------------
# fusing and reordering rows


@pytest.mark.parametrize(("kind", "group_size"), [("int8", 0), ("int4", 32)])
def test_concat_rows_fuses_along_rows(kind, group_size) -> None:
    torch.manual_seed(10)
    parts = [rtn(kind, torch.randn(rows, 128), group_size) for rows in (16, 8, 8)]
    fused = concat_rows(parts)
    assert (fused.kind, fused.group_size, fused.shape) == (kind, group_size, (32, 128))
    assert torch.equal(fused.dequantize(), torch.cat([p.dequantize() for p in parts]))
    assert fused.nbytes == sum(p.nbytes for p in parts)


def test_concat_rows_fuses_gguf_q8_0_groups() -> None:
    rng = np.random.default_rng(11)
    raws = [gguf_weight(rng, QType.Q8_0, rows, 64) for rows in (4, 6)]
    fused = concat_rows([gguf_int8(raw, (raw.shape[0], 64)) for raw, _ in raws])
    assert np.array_equal(fused.dequantize().numpy(), np.concatenate([ref for _, ref in raws]))


def test_concat_rows_rejects_mismatched_parts() -> None:
    torch.manual_seed(12)
    w = torch.randn(8, 128)
    g32, g64 = quantize_int4(w, 32), quantize_int4(w, 64)
    with pytest.raises(ValueError, match="g64"):
        concat_rows([g32, g64])
    with pytest.raises(ValueError, match="int8"):
        concat_rows([g32, quantize_int8(w)])
    with pytest.raises(ValueError, match="K=64"):
        concat_rows([g32, quantize_int4(torch.randn(8, 64), 32)])


@pytest.mark.parametrize(("kind", "group_size"), [("int8", 0), ("int4", 32)])
def test_map_rows_permutes_codes_scales_and_zeros_together(kind, group_size) -> None:
    torch.manual_seed(13)
    # rows of very different ranges, so a scale left on the wrong row shows
    qw = rtn(kind, torch.randn(16, 64) * torch.logspace(-2, 1, 16)[:, None], group_size)
    perm = torch.randperm(16)
    mapped = qw.map_rows(lambda t: t[perm])
    assert (mapped.kind, mapped.group_size) == (kind, group_size)
    assert torch.equal(mapped.dequantize(), qw.dequantize()[perm])
    # the loader's rope un-permutation is a reshape/transpose, also on 2-D scales
    heads = 2
    unperm = qw.map_rows(lambda t: t.reshape(heads, 4, 2, *t.shape[1:]).transpose(1, 2).reshape(t.shape))
    dense = qw.dequantize()
    assert torch.equal(unperm.dequantize(), dense.reshape(heads, 4, 2, 64).transpose(1, 2).reshape(16, 64))


# ---------------------------------------------------------------------------------------------
# the plan: which form each weight takes

LINEAR = "layers.0.self_attn.qkv_proj"


@pytest.fixture(scope="module")
def weights() -> dict[str, torch.Tensor | QuantizedWeight]:
    rng = np.random.default_rng(14)
    raw, _ = gguf_weight(rng, QType.Q8_0, 64, 128)
    torch.manual_seed(14)
    dense = torch.randn(64, 128) * 0.05
    return {"dense": dense, "int4": quantize_int4(dense, 32), "int8_g32": gguf_int8(raw, (64, 128)),
            "int8": quantize_int8(dense)}


# (method, dtype, source) -> expected form: a dtype for a dense tensor, ("int8"|"int4", group size), or
# "same" for the stored QuantizedWeight itself. bf16/f16/none are dense in the engine's dtype (for
# bf16/f16 that dtype is theirs: resolve_model_dtype refuses a contradicting one).
F32, BF16 = torch.float32, torch.bfloat16
PLAN = {
    ("auto", F32): {"dense": F32, "int4": "same", "int8_g32": "same", "int8": "same"},
    ("auto", BF16): {"dense": BF16, "int4": "same", "int8_g32": "same", "int8": "same"},
    ("int8", F32): {"dense": ("int8", 0), "int4": ("int8", 0), "int8_g32": ("int8", 0), "int8": "same"},
    ("int8", BF16): {"dense": ("int8", 0), "int4": ("int8", 0), "int8_g32": ("int8", 0), "int8": "same"},
    ("int4", F32): {"dense": ("int4", 32), "int4": "same", "int8_g32": ("int4", 32), "int8": ("int4", 32)},
    ("int4", BF16): {"dense": ("int4", 32), "int4": "same", "int8_g32": ("int4", 32), "int8": ("int4", 32)},
}
for _m in ("none", "bf16", "f16"):
    for _dt in (F32, BF16):
        PLAN[_m, _dt] = dict.fromkeys(("dense", "int4", "int8_g32", "int8"), _dt)


def dense_of(weight: torch.Tensor | QuantizedWeight) -> torch.Tensor:
    return weight.dequantize() if isinstance(weight, QuantizedWeight) else weight.float()


@pytest.mark.parametrize(("method", "dtype"), sorted(PLAN, key=str), ids=lambda v: str(v))
@pytest.mark.parametrize("source", ["dense", "int4", "int8_g32", "int8"])
def test_final_form(weights, method, dtype, source) -> None:
    expect = PLAN[method, dtype][source]
    weight = weights[source]
    out = final_form(QuantConfig(method), LINEAR, weight, dtype)
    if expect == "same":
        assert out is weight
    elif isinstance(expect, torch.dtype):
        assert isinstance(out, torch.Tensor) and out.dtype == expect
        assert torch.equal(out, dense_of(weight).to(expect))  # a stored weight is dequantized exactly
    else:
        assert isinstance(out, QuantizedWeight) and (out.kind, out.group_size) == expect
        assert out.shape == (64, 128)
        assert float(half_step_excess(out, dense_of(weight)).max()) <= 1 + 1e-5  # re-quantized from it


@pytest.mark.parametrize("method", ["bf16", "f16"])
def test_final_form_dense_16bit_in_its_own_dtype(weights, method) -> None:
    cfg = QuantConfig(method)
    dtype = resolve_model_dtype("auto", cfg)
    for weight in weights.values():
        out = final_form(cfg, LINEAR, weight, dtype)
        assert out.dtype == {"bf16": torch.bfloat16, "f16": torch.float16}[method]


@pytest.mark.parametrize("method", QUANTIZATION_METHODS)
@pytest.mark.parametrize("name", ["model.embed_tokens", "lm_head"])
def test_keep_16bit_names_stay_dense(weights, method, name) -> None:
    keep = ("embed_tokens", "lm_head") if method == "auto" else None  # auto's own default reads the head in 8 bits
    for source in ("dense", "int4", "int8_g32"):
        out = final_form(QuantConfig(method, keep_16bit=keep), name, weights[source], torch.bfloat16)
        assert isinstance(out, torch.Tensor) and out.dtype == torch.bfloat16
        assert torch.equal(out, dense_of(weights[source]).bfloat16())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_auto_keeps_the_lm_head_as_stored(weights, dtype) -> None:
    """Under auto the LM head is held as any linear: as the file stores it (a stored Q8_0 table is
    read as it is), dense when stored dense; the embeddings stay dense."""
    for source in ("dense", "int4", "int8_g32", "int8"):
        out = final_form(QuantConfig("auto"), "lm_head", weights[source], dtype)
        if source == "dense":
            assert isinstance(out, torch.Tensor) and out.dtype == dtype
        else:
            assert out is weights[source]
        assert isinstance(final_form(QuantConfig("auto"), "model.embed_tokens", weights[source], dtype), torch.Tensor)
    assert QuantConfig("auto").dense_modules == ("embed_tokens",)
    assert QuantConfig("int4").dense_modules == ("embed_tokens", "lm_head")


def test_keep_16bit_matches_whole_name_parts(weights) -> None:
    cfg = QuantConfig("int4", keep_16bit=("down_proj",))
    assert isinstance(final_form(cfg, "layers.3.mlp.down_proj", weights["dense"], torch.float32), torch.Tensor)
    # lm_head is no longer kept once keep_16bit is replaced, and a mere prefix does not match
    assert isinstance(final_form(cfg, "lm_head", weights["dense"], torch.float32), QuantizedWeight)
    assert isinstance(final_form(cfg, "layers.3.mlp.down_proj_x", weights["dense"], torch.float32),
                      QuantizedWeight)


def test_int4_with_other_group_size_requantizes_stored_codes(weights) -> None:
    stored = weights["int4"]
    out = final_form(QuantConfig("int4", 64), LINEAR, stored, torch.bfloat16)
    assert isinstance(out, QuantizedWeight) and (out.kind, out.group_size, out.shape) == ("int4", 64, stored.shape)
    assert out.scales.shape == (64, 2)
    assert float(half_step_excess(out, stored.dequantize()).max()) <= 1 + 1e-5


def test_int4_group_that_does_not_divide_k_names_the_layer() -> None:
    with pytest.raises(ValueError, match=r"128 .*layers\.2\.mlp\.down_proj"):
        final_form(QuantConfig("int4", 128), "layers.2.mlp.down_proj", torch.randn(8, 192), torch.float32)


@pytest.mark.parametrize(("method", "expect"), [
    ("auto", True), ("none", False), ("bf16", False), ("f16", False), ("int8", True), ("int4", True),
    ("w8a8", True), ("q8", True), ("q4k", True)], ids=str)
def test_quantizes_weights(method, expect) -> None:
    assert quantizes_weights(QuantConfig(method)) is expect


# ---------------------------------------------------------------------------------------------
# bad settings


def test_unknown_method_names_the_choices() -> None:
    with pytest.raises(ValueError, match="int3") as exc:
        QuantConfig(method="int3")
    assert all(m in str(exc.value) for m in QUANTIZATION_METHODS)


@pytest.mark.parametrize("group_size", [0, 16, 48, 512])
def test_bad_group_size_raises(group_size) -> None:
    with pytest.raises(ValueError, match=str(group_size)):
        QuantConfig("int4", group_size)


def test_quantize_int4_names_group_size_and_layer() -> None:
    with pytest.raises(ValueError, match=r"64 .*96 .*layers\.3\.mlp\.down_proj"):
        quantize_int4(torch.randn(8, 96), 64, "layers.3.mlp.down_proj")
    with pytest.raises(ValueError, match="48"):
        quantize_int4(torch.randn(8, 96), 48)


def test_resolve_model_dtype() -> None:
    with pytest.raises(ValueError, match="contradicts"):
        resolve_model_dtype("float32", QuantConfig("bf16"))
    with pytest.raises(ValueError, match="contradicts"):
        resolve_model_dtype("bf16", QuantConfig("f16"))
    assert resolve_model_dtype("auto", QuantConfig("bf16")) is torch.bfloat16
    assert resolve_model_dtype("auto", QuantConfig("f16")) is torch.float16
    assert resolve_model_dtype("bfloat16", QuantConfig("bf16")) is torch.bfloat16
    assert resolve_model_dtype("float32", QuantConfig("int4")) is torch.float32


def test_build_engine_config_quantization() -> None:
    assert build_engine_config(quantization="int4", group_size=64).quantization == QuantConfig("int4", 64)
    assert build_engine_config(quantization=QuantConfig("int8"), group_size=128).quantization == \
        QuantConfig("int8", 128)
    assert build_engine_config().quantization == QuantConfig()
    with pytest.raises(ValueError, match="nope"):
        build_engine_config(quantization="nope")
    with pytest.raises(ValueError, match="48"):
        build_engine_config(quantization="int4", group_size=48)


def test_int4_rows_not_a_multiple_of_16_fall_back_to_int8() -> None:
    # The packed int4 layout tiles rows by 16; such a layer is kept int8 rather than failing at load.
    w = torch.randn(100, 64) * 0.05
    out = final_form(QuantConfig("int4", keep_16bit=()), "layers.0.odd_proj", w, torch.bfloat16)
    assert isinstance(out, QuantizedWeight) and out.kind == "int8"
    QuantLinear(out)(torch.randn(2, 64))


def test_fuse_pieces_packed_differently_become_int8() -> None:
    # A Q4_K file whose attn_v is Q8_0 (or Q6_K, handed over as float): one fused qkv must still load.
    torch.manual_seed(9)
    q, k, v = (torch.randn(32, 64) * 0.05 for _ in range(3))
    same = fuse_pieces([quantize_int4(q, 32), quantize_int4(k, 32)])
    assert same.kind == "int4" and same.shape == (64, 64)
    for v_piece in (quantize_int8(v), v):
        fused = fuse_pieces([quantize_int4(q, 32), quantize_int4(k, 32), v_piece])
        assert isinstance(fused, QuantizedWeight) and fused.kind == "int8" and fused.group_size == 0
        assert fused.shape == (96, 64)
        ref = torch.cat([quantize_int4(q, 32).dequantize(), quantize_int4(k, 32).dequantize(),
                         v_piece.dequantize() if isinstance(v_piece, QuantizedWeight) else v])
        step = fused.scales[:, None]
        assert ((fused.dequantize() - ref).abs() <= step / 2 + 1e-6).all()
    dense = fuse_pieces([q, k, v])
    assert isinstance(dense, torch.Tensor) and torch.equal(dense, torch.cat([q, k, v]))
