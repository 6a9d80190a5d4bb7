"""The Triton layer kernels, and our C++ CPU ones (layers/csrc/fused_ops.cpp), against their torch
references (ruvllm.layers.ops).

Without a GPU the kernels run under Triton's interpreter (TRITON_INTERPRET=1, set in tests/conftest.py
before the kernels are decorated), so CI covers them; with one, on CUDA. The interpreter stores fp32
into a bf16 pointer by truncation (not rounding) and keeps `.to(tl.bfloat16)` values at fp32
precision, so bf16 results are compared within ~2 bf16 ulps; fp32 results tightly.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ruvllm.layers.ops import LayerOps, cpu_ops, select_ops, torch_ops, triton_ops
from ruvllm.layers.rotary import RotaryEmbedding

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
DTYPES = [torch.float32, torch.bfloat16]
TOKENS = ["1", "many"]


def _rows(tops: LayerOps, tokens: str = "many") -> int:
    """A case's row count. Triton's interpreter (no GPU) runs each row's program in Python: 9 rows
    check what 37 do there (row strides, rows apart, partial slices) at a quarter of the time (this
    file took 29 s of CPU, nearly all of it in the interpreter at 37 rows). A GPU, and our C++
    kernels (threads take rows in grains of 16: 37 rows are three grains), get 37."""
    if tokens == "1":
        return 1
    return 9 if tops.name == "triton" and DEVICE.type == "cpu" else 37


def _tol(dtype: torch.dtype) -> dict[str, float]:
    return {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 1.6e-2, "rtol": 1.6e-2}


def _randn(*shape: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(dtype=dtype, device=DEVICE)


@pytest.fixture(scope="module", params=["triton", "cpu"])
def tops(request: pytest.FixtureRequest) -> LayerOps:
    if request.param == "triton":
        pytest.importorskip("triton")
        return triton_ops()
    from ruvllm.cpu_build import kernels

    if DEVICE.type != "cpu" or kernels() is None:
        pytest.skip("our C++ CPU kernels: CPU tensors, where they build")
    return cpu_ops(kernels())


@pytest.fixture(scope="module")
def rops() -> LayerOps:
    return torch_ops()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", TOKENS)
@pytest.mark.parametrize("hidden", [64, 576, 960, 5000])  # 5000: two chunks of the 4096 row block
@pytest.mark.parametrize("with_residual", [False, True])
def test_add_rms_norm(tops, rops, dtype, tokens, hidden, with_residual):
    tokens = _rows(tops, tokens)
    x = _randn(tokens, hidden, dtype=dtype, seed=1)
    residual = _randn(tokens, hidden, dtype=dtype, seed=2) * 4 if with_residual else None
    weight = _randn(hidden, dtype=dtype, seed=3)
    normed, new_res = tops.add_rms_norm(x, residual, weight, 1e-6)
    ref_normed, ref_res = rops.add_rms_norm(x, residual, weight, 1e-6)
    assert normed.shape == ref_normed.shape and normed.dtype == dtype and new_res.dtype == dtype
    if residual is None:
        assert new_res is x
    elif dtype == torch.float32 or DEVICE.type == "cuda":
        # One rounded add, the same on both sides (the interpreter truncates bf16 stores instead).
        assert torch.equal(new_res, ref_res)
    else:
        torch.testing.assert_close(new_res, ref_res, **_tol(dtype))
    torch.testing.assert_close(normed, ref_normed, **_tol(dtype))


def test_torch_add_rms_norm_is_the_llama_arithmetic(rops):
    for dtype in DTYPES:
        x = _randn(37, 960, dtype=dtype, seed=4)
        o = _randn(37, 960, dtype=dtype, seed=5)
        weight = _randn(960, dtype=dtype, seed=6)
        # DecoderLayer: x = x + o_proj(o); h = post_attention_layernorm(x)
        want_x = x + o
        want_h = F.rms_norm(want_x, (960,), weight, 1e-5)
        h, new_x = rops.add_rms_norm(o, x, weight, 1e-5)
        assert torch.equal(new_x, want_x) and torch.equal(h, want_h)
        h0, same = rops.add_rms_norm(x, None, weight, 1e-5)
        assert same is x and torch.equal(h0, F.rms_norm(x, (960,), weight, 1e-5))


def _qk_views(tokens: int, heads: int, kv_heads: int, head_dim: int, dtype, seed: int):
    """q [T, heads, D] and k [T, kv_heads, D] as the model has them: strided views into one fused
    q/k/v projection output."""
    fused = _randn(tokens, (heads + 2 * kv_heads) * head_dim, dtype=dtype, seed=seed)
    q, k, _ = fused.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    return q.view(tokens, heads, head_dim), k.view(tokens, kv_heads, head_dim)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", TOKENS)
@pytest.mark.parametrize("hidden", [96, 960])
def test_rms_norm_2d(tops, rops, dtype, tokens, hidden):
    tokens = _rows(tops, tokens)
    x = _randn(tokens, hidden, dtype=dtype, seed=7)
    weight = _randn(hidden, dtype=dtype, seed=8)
    torch.testing.assert_close(tops.rms_norm(x, weight, 1e-6), rops.rms_norm(x, weight, 1e-6), **_tol(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", TOKENS)
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(3, 1, 64), (4, 2, 128), (2, 1, 80)])
def test_rms_norm_per_head_on_views(tops, rops, dtype, tokens, heads, kv_heads, head_dim):
    # Qwen3's q/k norm: per head over head_dim, on views into the fused q/k/v projection output.
    tokens = _rows(tops, tokens)
    q, k = _qk_views(tokens, heads, kv_heads, head_dim, dtype, seed=9)
    assert not q.is_contiguous() or tokens == 1
    weight = _randn(head_dim, dtype=dtype, seed=10)
    for t in (q, k):
        got = tops.rms_norm(t, weight, 1e-6)
        assert got.shape == t.shape
        torch.testing.assert_close(got, rops.rms_norm(t, weight, 1e-6), **_tol(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", TOKENS)
@pytest.mark.parametrize("inter", [64, 1536, 2560])  # 2560: 1024-wide column blocks, the last partly masked
def test_silu_and_mul(tops, rops, dtype, tokens, inter):
    tokens = _rows(tops, tokens)
    gate_up = _randn(tokens, 2 * inter, dtype=dtype, seed=11) * 3
    got = tops.silu_and_mul(gate_up)
    assert got.shape == (tokens, inter) and got.dtype == dtype
    torch.testing.assert_close(got, rops.silu_and_mul(gate_up), **_tol(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", TOKENS)
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(3, 1, 64), (4, 2, 128), (5, 5, 80)])
def test_rope_on_fused_views(tops, rops, dtype, tokens, heads, kv_heads, head_dim):
    tokens = _rows(tops, tokens)
    q, k = _qk_views(tokens, heads, kv_heads, head_dim, dtype, seed=12)
    rope = RotaryEmbedding(head_dim, 4096, 500000.0, {"rope_type": "llama3", "factor": 8.0}, dtype, DEVICE)
    positions = torch.randint(0, 4096, (tokens,), generator=torch.Generator().manual_seed(13)).to(DEVICE)
    cos, sin = rope.for_positions(positions)
    before = q.clone(), k.clone()
    got_q, got_k = tops.rope(q, k, cos, sin)
    ref_q, ref_k = rops.rope(q, k, cos, sin)
    assert torch.equal(q, before[0]) and torch.equal(k, before[1])  # inputs untouched
    for got, ref in ((got_q, ref_q), (got_k, ref_k)):
        assert got.is_contiguous() and got.shape == ref.shape and got.dtype == ref.dtype
        torch.testing.assert_close(got, ref, **_tol(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", TOKENS)
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (4, 2, 128)])
def test_qkv_rope(tops, rops, dtype, tokens, heads, kv_heads, head_dim):
    tokens = _rows(tops, tokens)
    width = (heads + 2 * kv_heads) * head_dim
    wide = _randn(tokens, width + 32, dtype=dtype, seed=19)
    qkv = wide[:, 16:16 + width]  # a view whose rows are further apart than their width
    rope = RotaryEmbedding(head_dim, 4096, 10000.0, None, dtype, DEVICE)
    positions = torch.randint(0, 4096, (tokens,), generator=torch.Generator().manual_seed(20)).to(DEVICE)
    cos, sin = rope.for_positions(positions)
    got = tops.qkv_rope(qkv, cos, sin, heads, kv_heads, head_dim)
    ref = rops.qkv_rope(qkv, cos, sin, heads, kv_heads, head_dim)
    for g, r in zip(got, ref):
        assert g.is_contiguous() and g.shape == r.shape and g.dtype == r.dtype
        torch.testing.assert_close(g, r, **_tol(dtype))
    assert torch.equal(got[2], ref[2])  # v is a copy


@pytest.mark.parametrize("dtype", DTYPES)
def test_rows_are_computed_alone(tops, dtype):
    """Each row's result is the same bits whether it runs alone or among others (batch invariance)."""
    n = _rows(tops)
    x = _randn(n, 576, dtype=dtype, seed=21)
    residual = _randn(n, 576, dtype=dtype, seed=22)
    weight = _randn(576, dtype=dtype, seed=23)
    gate_up = _randn(n, 2 * 1536, dtype=dtype, seed=24)
    rope = RotaryEmbedding(64, 256, 10000.0, None, dtype, DEVICE)
    cos, sin = rope.for_positions(torch.arange(n, device=DEVICE))
    qkv = _randn(n, 15 * 64, dtype=dtype, seed=25)

    def run(rows: slice) -> list[torch.Tensor]:
        return [*tops.add_rms_norm(x[rows], residual[rows], weight, 1e-5), tops.rms_norm(x[rows], weight, 1e-5),
                tops.silu_and_mul(gate_up[rows]), *tops.qkv_rope(qkv[rows], cos[rows], sin[rows], 9, 3, 64)]

    full = run(slice(0, n))
    for rows in (slice(0, 1), slice(5, 6), slice(3, n // 2 + 2)):  # at 37 rows 3:20, at 9 rows 3:6
        for part, whole in zip(run(rows), full):
            assert torch.equal(part, whole[rows])


def test_select_ops():
    from ruvllm.cpu_build import kernels

    assert select_ops(torch.device("cpu")).name == ("torch" if kernels() is None else "cpu")
    if torch.cuda.is_available():
        assert select_ops(torch.device("cuda")).name == ("triton" if _has_triton() else "torch")


def _has_triton() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def test_fp16_all_ops(tops, rops):
    tol = {"atol": 2e-3, "rtol": 2e-3}
    n = _rows(tops)
    x = _randn(n, 960, dtype=torch.float16, seed=14)
    residual = _randn(n, 960, dtype=torch.float16, seed=15)
    weight = _randn(960, dtype=torch.float16, seed=16)
    for got, ref in zip(tops.add_rms_norm(x, residual, weight, 1e-6), rops.add_rms_norm(x, residual, weight, 1e-6)):
        torch.testing.assert_close(got, ref, **tol)
    gate_up = _randn(n, 2 * 1536, dtype=torch.float16, seed=17)
    torch.testing.assert_close(tops.silu_and_mul(gate_up), rops.silu_and_mul(gate_up), **tol)
    fused = _randn(n, 8 * 64, dtype=torch.float16, seed=18)
    q, k, _ = fused.split([4 * 64, 2 * 64, 2 * 64], dim=-1)
    q, k = q.view(n, 4, 64), k.view(n, 2, 64)
    rope = RotaryEmbedding(64, 256, 10000.0, None, torch.float16, DEVICE)
    cos, sin = rope.for_positions(torch.arange(n, device=DEVICE))
    for got, ref in zip(tops.rope(q, k, cos, sin), rops.rope(q, k, cos, sin)):
        torch.testing.assert_close(got, ref, **tol)
    torch.testing.assert_close(tops.rms_norm(q, weight[:64], 1e-6), rops.rms_norm(q, weight[:64], 1e-6), **tol)
