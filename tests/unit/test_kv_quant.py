"""The cold tier's K/V format (attention/kv_quant.py) and attention over a two-tier cache: round-trip
bounds, the C++ kernel and the PyTorch path against a float64 reference, and the property the
engine's invariances rest on: a block reads the same bits whether it has moved to the cold tier or
is fake-quantized in place, so no row depends on when its blocks moved or what shared its step."""

from __future__ import annotations

import math

import pytest
import torch

from ruvllm.attention.cpu_kernels import cold_tier_kernels, paged_attention
from ruvllm.attention.kv_quant import (KVTier, ColdLayer, check_kv_cache_dtype, code_dtype, code_width,
                                       dequantize_rows, fake_quantize, meta_width, quantize_rows)
from ruvllm.attention.metadata import build_attention_metadata, build_paged_kernel_metadata
from ruvllm.attention.torch_paged import TorchPagedAttention
from tests.unit.paged_reference import BLOCK, random_step

kernels = cold_tier_kernels()
needs_kernel = pytest.mark.skipif(kernels is None, reason="no C++ compiler to build the kernel")


def _rows(seed: int = 0) -> torch.Tensor:
    """Rows of 64 values: Gaussian, with outliers, all equal, all zero, tiny, huge, one-signed."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(64, 3, 64, generator=g)
    x[1, :, 5] = 40.0  # an outlier channel
    x[2] = 0.7
    x[3] = 0.0
    x[4] *= 1e-6
    x[5] *= 3e3
    x[6] = x[6].abs() + 5  # all positive, far from zero
    return x


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_round_trip_is_within_half_a_step(dtype: torch.dtype) -> None:
    x = _rows().to(dtype)
    codes, meta = quantize_rows(x, 8)
    assert codes.dtype == torch.int8 and codes.shape == x.shape and meta.shape == (*x.shape[:-1], 1)
    assert meta.dtype == torch.float16
    assert codes.abs().max() <= 127
    y = dequantize_rows(codes, meta, 8)
    step = meta.float()
    err = (y - x.float()).abs()
    # half a step, plus the fp16 rounding of the scale (relative 2^-11, or half the subnormal spacing
    # 2^-25 for rows under ~1e-2) at the row's largest value, 127 steps out
    amax = x.float().abs().amax(-1, keepdim=True)
    assert (err <= step * 0.5 + amax * 2**-11 + 127 * 2**-25).all()
    assert torch.equal(y[3], torch.zeros_like(y[3]))  # zeros stay exact
    big = amax.squeeze(-1) > 1e-2
    assert (err.amax(-1)[big] <= amax.squeeze(-1)[big] / 254 * 1.01).all()  # 0.4% of the row's largest value


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int4_round_trip_is_within_half_a_step(dtype: torch.dtype) -> None:
    x = _rows(1).to(dtype)
    codes, meta = quantize_rows(x, 4)
    assert codes.dtype == torch.uint8 and codes.shape == (*x.shape[:-1], 32) and meta.shape == (*x.shape[:-1], 2)
    y = dequantize_rows(codes, meta, 4)
    xf = x.float()
    lo, hi = xf.amin(-1, keepdim=True), xf.amax(-1, keepdim=True)
    step = meta[..., :1].float()
    m = meta[..., 1:].float()
    # codes cover [m, m + 15 s]; m and s are fp16 roundings of min and (max - m) / 15
    slack = (m - lo).abs() + (hi - m) * 2**-11 + 15 * 2**-25
    assert ((y - xf).abs() <= step * 0.5 + slack + 1e-12).all()
    assert ((y - xf).abs() <= (hi - lo) / 30 + slack + 1e-12).all()
    assert torch.equal(y[2], xf[2].half().float()) and torch.equal(y[3], xf[3])  # constant rows: their fp16 value
    # packing: even index in the low nibble
    q = torch.tensor([[1, 15, 0, 7]], dtype=torch.float32)
    c, mm = quantize_rows(q, 4)
    assert c.tolist() == [[1 | (15 << 4), 0 | (7 << 4)]] and dequantize_rows(c, mm, 4).tolist() == q.tolist()


def test_fake_quantize_keeps_dtype_and_is_idempotent_enough() -> None:
    x = _rows(2).bfloat16()
    for bits in (8, 4):
        y = fake_quantize(x, bits)
        assert y.dtype == torch.bfloat16 and y.shape == x.shape
    with pytest.raises(ValueError, match="8 or 4"):
        quantize_rows(x, 3)
    with pytest.raises(ValueError, match="even"):
        code_width(65, 4)


# ------------------------------------------------------------------------------- attention over two tiers

NUM_HOT = 64  # random_step's cache has 64 blocks; cold ids follow


def _two_tier_step(dtype: torch.dtype, bits: int, hot_tokens: int, seed: int = 0, hq: int = 6, hkv: int = 2):
    """random_step's cache and rows, with some of the blocks every row reads as old moved to a
    cold tier (quantized by `quantize`), their table entries pointing there."""
    q, kc, vc, tables, row_seq, row_ctx = random_step(dtype, hq, hkv, seed=seed)
    dim = q.shape[-1]
    num_cold = 64
    codes = torch.zeros(1, 2, num_cold * BLOCK, hkv, code_width(dim, bits), dtype=code_dtype(bits))
    meta = torch.zeros(1, 2, num_cold * BLOCK, hkv, meta_width(bits), dtype=torch.float16)
    hot = torch.stack([kc, vc]).unsqueeze(0)  # [1, 2, slots, hkv, dim]
    tables = tables.clone()
    first_ctx = {}
    for s, c in zip(row_seq.tolist(), row_ctx.tolist()):
        first_ctx.setdefault(s, c)
    moves = []
    for s in range(tables.shape[0]):
        # blocks old for the sequence's first row this step: the engine would have moved them
        old = max(0, (first_ctx[s] - hot_tokens) // BLOCK)
        for b in range(old):
            if b % 3 != 2:  # leave some behind, as a full cold tier would
                moves.append((int(tables[s, b]), len(moves)))
                tables[s, b] = NUM_HOT + len(moves) - 1
    return q, hot, codes, meta, tables, row_seq, row_ctx, moves


def _move(hot, codes, meta, moves, bits, quantize) -> None:
    src = torch.tensor([h for h, _ in moves], dtype=torch.long)
    dst = torch.tensor([c for _, c in moves], dtype=torch.long)
    offs = torch.arange(BLOCK)
    quantize(hot, (src[:, None] * BLOCK + offs).flatten(), codes, meta, (dst[:, None] * BLOCK + offs).flatten(), bits)


def _torch_quantize(hot, src, codes, meta, dst, bits) -> None:
    TorchPagedAttention().quantize_blocks(hot, src, codes, meta, dst, bits)


def _reference(q, hot, codes, meta, tables, row_seq, row_ctx, scale, tier: KVTier, fq) -> torch.Tensor:
    """float64: row with context c reads block b dequantized from the cold tier, or `fq` of the hot
    block when (b + 1) * BLOCK <= c - hot_tokens, else exactly."""
    out = torch.empty(q.shape, dtype=torch.float64)
    group = q.shape[1] // hot.shape[3]
    for r in range(q.shape[0]):
        ctx = int(row_ctx[r])
        keys, values = [], []
        for b in range(-(-ctx // BLOCK)):
            bid = int(tables[row_seq[r], b])
            n = min(BLOCK, ctx - b * BLOCK)
            if bid >= tier.num_hot_blocks:
                sl = slice((bid - tier.num_hot_blocks) * BLOCK, (bid - tier.num_hot_blocks) * BLOCK + n)
                kv = [dequantize_rows(codes[0, i, sl], meta[0, i, sl], tier.bits) for i in (0, 1)]
            else:
                kv = [hot[0, i, bid * BLOCK:bid * BLOCK + n] for i in (0, 1)]
                if (b + 1) * BLOCK <= ctx - tier.hot_tokens:
                    kv = [fq(x) for x in kv]
            keys.append(kv[0].double())
            values.append(kv[1].double())
        k = torch.cat(keys).repeat_interleave(group, dim=1)
        v = torch.cat(values).repeat_interleave(group, dim=1)
        p = (torch.einsum("hd,thd->ht", q[r].double(), k) * scale).softmax(-1)
        out[r] = torch.einsum("ht,thd->hd", p, v)
    return out


def _kernel_call(q, hot, codes, meta, tables, row_seq, row_ctx, scale, tier: KVTier) -> torch.Tensor:
    return kernels.attention(q, hot[0, 0], hot[0, 1], codes[0, 0], codes[0, 1], meta[0, 0], meta[0, 1], tables,
                             row_seq, row_ctx, BLOCK, scale, tier.num_hot_blocks, tier.hot_tokens, tier.bits)


def _kernel_fq(bits: int):
    """Fake quantization with the kernel's own quantizer (moving one block through a scratch tier)."""
    def fq(x: torch.Tensor) -> torch.Tensor:
        n, h, d = x.shape
        hot = torch.zeros(1, 2, BLOCK, h, d, dtype=x.dtype)
        hot[0, 0, :n] = x
        c = torch.zeros(1, 2, BLOCK, h, code_width(d, bits), dtype=code_dtype(bits))
        m = torch.zeros(1, 2, BLOCK, h, meta_width(bits), dtype=torch.float16)
        kernels.quantize(hot, torch.arange(BLOCK), c, m, torch.arange(BLOCK), bits)
        return dequantize_rows(c[0, 0, :n], m[0, 0, :n], bits)
    return fq


@needs_kernel
@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hot_tokens", [0, 20, 64])
def test_kernel_two_tier_matches_reference(dtype: torch.dtype, bits: int, hot_tokens: int) -> None:
    q, hot, codes, meta, tables, row_seq, row_ctx, moves = _two_tier_step(dtype, bits, hot_tokens)
    _move(hot, codes, meta, moves, bits, kernels.quantize)
    tier = KVTier(NUM_HOT, hot_tokens, bits)
    out = _kernel_call(q, hot, codes, meta, tables, row_seq, row_ctx, 0.125, tier)
    ref = _reference(q, hot, codes, meta, tables, row_seq, row_ctx, 0.125, tier, _kernel_fq(bits))
    tol = 1e-5 if dtype == torch.float32 else 1.6e-2
    torch.testing.assert_close(out.double(), ref, atol=tol, rtol=tol)
    # and it did not ignore the quantization: the exact (all-hot) answer differs
    unmoved = random_step(dtype, 6, 2)[3]
    exact = paged_attention()(q, hot[0, 0], hot[0, 1], unmoved, row_seq, row_ctx, BLOCK, 0.125)
    assert (exact.double() - out.double()).abs().max() > (3e-3 if bits == 8 else 3e-2)


@needs_kernel
@pytest.mark.parametrize("bits", [8, 4])
def test_kernel_moved_or_not_reads_the_same_bits(bits: int) -> None:
    """A block old for every row reads the same whether it moved to the cold tier or not, and each
    row is the same alone, in any company, or in a chunk split differently."""
    q, hot, codes, meta, tables, row_seq, row_ctx, moves = _two_tier_step(torch.bfloat16, bits, 20, seed=3)
    _move(hot, codes, meta, moves, bits, kernels.quantize)
    tier = KVTier(NUM_HOT, 20, bits)
    moved = _kernel_call(q, hot, codes, meta, tables, row_seq, row_ctx, 0.125, tier)
    _, _, _, _, unmoved_tables, _, _, _ = _two_tier_step(torch.bfloat16, bits, 10**9, seed=3)  # nothing moved
    assert torch.equal(_kernel_call(q, hot, codes, meta, unmoved_tables, row_seq, row_ctx, 0.125, tier), moved)
    for r in range(q.shape[0]):
        s = int(row_seq[r])
        alone = _kernel_call(q[r:r + 1].contiguous(), hot, codes, meta, tables[s:s + 1], torch.tensor([0]),
                             row_ctx[r:r + 1], 0.125, tier)
        assert torch.equal(alone, moved[r:r + 1]), r
    rows = (row_seq == 6).nonzero().flatten()  # the 70-row prompt: split in two calls
    parts = [_kernel_call(q[i].contiguous(), hot, codes, meta, tables[6:7], torch.zeros(len(i), dtype=torch.long),
                          row_ctx[i], 0.125, tier) for i in (rows[:23], rows[23:])]
    assert torch.equal(torch.cat(parts), moved[rows])


@needs_kernel
def test_kernel_rejects_bad_cold_tier() -> None:
    q, hot, codes, meta, tables, row_seq, row_ctx, _ = _two_tier_step(torch.float32, 8, 20)
    tier = KVTier(NUM_HOT, 20, 8)
    with pytest.raises(RuntimeError, match="8 or 4 bits"):
        _kernel_call(q, hot, codes, meta, tables, row_seq, row_ctx, 0.1, KVTier(NUM_HOT, 20, 5))
    with pytest.raises(RuntimeError, match="int8 codes are int8"):
        _kernel_call(q, hot, codes.view(torch.uint8), meta, tables, row_seq, row_ctx, 0.1, tier)
    with pytest.raises(RuntimeError, match="float16"):
        _kernel_call(q, hot, codes, meta.float(), tables, row_seq, row_ctx, 0.1, tier)
    with pytest.raises(RuntimeError, match="outside the pool"):
        _kernel_call(q, hot, codes, meta, tables + 1000, row_seq, row_ctx, 0.1, tier)
    with pytest.raises(RuntimeError, match="out of range"):
        kernels.quantize(hot, torch.tensor([10**6]), codes, meta, torch.tensor([0]), 8)


def _torch_path(q, hot, codes, meta, tables, row_seq, row_ctx, scale, tier: KVTier) -> torch.Tensor:
    """The PyTorch path over the same step: metadata from the block tables, new keys already in place."""
    seqs = []
    for s in range(tables.shape[0]):
        ctx = row_ctx[row_seq == s]
        n, c = ctx.numel(), int(ctx.max())
        seqs.append((n, c, tables[s, :-(-c // BLOCK)].tolist()))
    order = torch.cat([(row_seq == s).nonzero().flatten() for s in range(tables.shape[0])])
    meta_ = build_attention_metadata(seqs, BLOCK, "cpu", tier)
    kc, vc = hot[0, 0], hot[0, 1]
    k_new, v_new = kc[meta_.slot_mapping].clone(), vc[meta_.slot_mapping].clone()  # rewrite what is there
    cold = ColdLayer(codes[0, 0], codes[0, 1], meta[0, 0], meta[0, 1])
    out = TorchPagedAttention().forward(q[order], k_new, v_new, kc, vc, meta_, scale, cold)
    result = torch.empty_like(out)
    result[order] = out
    return result


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("hot_tokens", [0, 20])
def test_torch_path_two_tier_matches_reference(bits: int, hot_tokens: int) -> None:
    q, hot, codes, meta, tables, row_seq, row_ctx, moves = _two_tier_step(torch.float32, bits, hot_tokens)
    _move(hot, codes, meta, moves, bits, _torch_quantize)
    tier = KVTier(NUM_HOT, hot_tokens, bits)
    out = _torch_path(q, hot, codes, meta, tables, row_seq, row_ctx, 0.125, tier)
    ref = _reference(q, hot, codes, meta, tables, row_seq, row_ctx, 0.125, tier, lambda x: fake_quantize(x, bits))
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)


@needs_kernel
@pytest.mark.parametrize("bits", [8, 4])
def test_torch_path_and_kernel_agree(bits: int) -> None:
    q, hot, codes, meta, tables, row_seq, row_ctx, moves = _two_tier_step(torch.float32, bits, 20, seed=5)
    tier = KVTier(NUM_HOT, 20, bits)
    c2, m2 = codes.clone(), meta.clone()
    _move(hot, codes, meta, moves, bits, kernels.quantize)
    _move(hot, c2, m2, moves, bits, _torch_quantize)
    a = _kernel_call(q, hot, codes, meta, tables, row_seq, row_ctx, 0.125, tier)
    b = _torch_path(q, hot, c2, m2, tables, row_seq, row_ctx, 0.125, tier)
    # two quantizers may round a code differently at an exact tie; the outputs stay close
    torch.testing.assert_close(a, b, atol=2e-3 if bits == 4 else 1e-4, rtol=0)
    assert (codes != c2).float().mean() < 1e-3


def test_kv_cache_dtype_checks() -> None:
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    check_kv_cache_dtype("int8", torch.bfloat16, cpu, "auto")
    check_kv_cache_dtype("bf16", torch.bfloat16, cuda, "auto")
    check_kv_cache_dtype("int8", torch.bfloat16, cuda, "auto")  # PyTorch's ops read the cold tier on a GPU
    with pytest.raises(ValueError, match="Triton kernel reads no quantized"):
        check_kv_cache_dtype("int8", torch.bfloat16, cuda, "triton")
    with pytest.raises(ValueError, match="Triton kernel reads no quantized"):
        check_kv_cache_dtype("int4", torch.float32, cpu, "triton")
    with pytest.raises(ValueError, match="needs the model to compute in fp16.*float32"):
        check_kv_cache_dtype("fp16", torch.float32, cpu, "auto")


def test_scale_of_huge_and_tiny_rows_stays_finite() -> None:
    x = torch.tensor([[1e30, -1e30, 0.0, 1.0], [1e-30, 0.0, -1e-30, 0.0]])
    for bits in (8, 4):
        y = fake_quantize(x, bits)
        assert torch.isfinite(y).all()
    assert math.isclose(float(fake_quantize(x, 8)[1].abs().max()), 0.0, abs_tol=1e-29)
