"""The Triton paged-attention kernel against a float64 reference on random paged caches, and each
row's bits independent of what else shares the launch. Without a GPU it runs through Triton's
interpreter (TRITON_INTERPRET=1, set in tests/conftest.py), so CI covers it; with one, on CUDA."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("triton")

from ruvllm.attention.triton_paged import TritonPagedAttention  # noqa: E402
from tests.unit.paged_reference import BLOCK, SEQS, random_step, reference_attention  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# Triton's interpreter computes bf16 arithmetic wrongly (measured with triton 3.9: a bf16 add or dot
# gives garbage), so on CPU fp16 stands in for the 16-bit path and bf16 runs on CUDA only.
BF16 = pytest.param(torch.bfloat16, marks=pytest.mark.skipif(DEVICE == "cpu", reason="bf16 needs a GPU"))


def _interpreted_dot_is_row_invariant() -> bool:
    """Whether the interpreter's tl.dot gives a row the same bits wherever it sits in the tile.

    Interpreted, tl.dot is numpy's matmul, i.e. numpy's bundled OpenBLAS. Some of its sgemm kernels
    compute a row differently by its position in the matrix: measured with OpenBLAS's Haswell kernel
    (an AVX2 CPU without AVX-512): a row moved by a few places in a 64 x 64 product changes its last
    bits, and this test failed for fp32 and fp16 alike; the same machine forced to its Sandybridge
    kernel (OPENBLAS_CORETYPE=Sandybridge) passed. No kernel's row can then equal itself alone and in
    company, so there the interpreter cannot show the property; on a GPU the kernel is run for real."""
    rng = np.random.default_rng(0)
    rows, cols = rng.standard_normal((64, 64), dtype=np.float32), rng.standard_normal((64, 64), dtype=np.float32)
    ref = rows @ cols.T  # the kernel's shapes: 64 rows (16 tokens x 4 query heads) by 64 keys, dim 64
    return all(np.array_equal(np.roll(rows, s, 0) @ cols.T, np.roll(ref, s, 0)) for s in range(1, 16))


ROW_INVARIANT_DOT = pytest.mark.skipif(
    DEVICE == "cpu" and not _interpreted_dot_is_row_invariant(),
    reason="Triton's interpreter computes tl.dot with numpy's BLAS, which on this CPU gives a row different "
           "bits at different positions of a matrix (OpenBLAS's Haswell sgemm kernel)")


def _run(backend, q, kc, vc, tables, seqs, scale):
    """Launch the kernel over caches already filled (no new keys written)."""
    lists = [(n, start + n, tables[i].tolist()) for i, (start, n) in enumerate(seqs)]
    meta = backend.build_metadata(lists, BLOCK, DEVICE)
    out = torch.full_like(q, float("nan"))  # every element must be written
    backend.launch(q, kc, vc, out, meta, scale)
    return out


@pytest.mark.parametrize(("hq", "hkv", "dim"), [(9, 3, 64), (4, 4, 32), (8, 1, 64), (4, 2, 80)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, BF16])
def test_kernel_matches_reference(dtype: torch.dtype, hq: int, hkv: int, dim: int) -> None:
    q, kc, vc, tables, row_seq, row_ctx = random_step(dtype, hq, hkv, dim)
    scale = dim ** -0.5
    backend = TritonPagedAttention(hq, hkv, dim)
    out = _run(backend, q.to(DEVICE), kc.to(DEVICE), vc.to(DEVICE), tables, SEQS, scale)
    assert out.dtype == dtype and out.shape == q.shape
    tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[dtype]
    torch.testing.assert_close(out.double().cpu(), reference_attention(q, kc, vc, tables, row_seq, row_ctx, scale),
                               atol=tol, rtol=tol)


@ROW_INVARIANT_DOT
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, BF16])
def test_each_row_is_the_same_alone_or_in_any_company(dtype: torch.dtype) -> None:
    q, kc, vc, tables, row_seq, row_ctx = (t.to(DEVICE) for t in random_step(dtype, 9, 3, seed=1))
    backend = TritonPagedAttention(9, 3, 64)
    together = _run(backend, q, kc, vc, tables, SEQS, 0.125)
    rows_of = {}
    first = 0
    for i, (start, n) in enumerate(SEQS):
        rows_of[i] = (first, start, n)
        first += n
    for i, (first, start, n) in rows_of.items():
        for j in (0, n - 1):  # a sequence's first and last row, each as a lone decode
            alone = _run(backend, q[first + j:first + j + 1], kc, vc, tables[i:i + 1], [(start + j, 1)], 0.125)
            assert torch.equal(alone, together[first + j:first + j + 1]), (i, j)
    # A prompt chunk split in two launches (chunked prefill) gives the bits of one launch.
    first, start, n = rows_of[5]
    a = _run(backend, q[first:first + 7], kc, vc, tables[5:6], [(start, 7)], 0.125)
    b = _run(backend, q[first + 7:first + n], kc, vc, tables[5:6], [(start + 7, n - 7)], 0.125)
    assert torch.equal(torch.cat([a, b]), together[first:first + n])


def test_forward_writes_new_keys_then_attends() -> None:
    """forward(): the step's keys and values land in their slots and are seen by the step's own rows."""
    torch.manual_seed(0)
    hq, hkv, dim = 4, 2, 32
    backend = TritonPagedAttention(hq, hkv, dim)
    kc = torch.zeros(8 * BLOCK, hkv, dim, device=DEVICE)
    vc = torch.zeros_like(kc)
    seqs = [(20, 20, [3, 5]), (1, 1, [6])]  # a whole prompt and a one-token prompt
    meta = backend.build_metadata(seqs, BLOCK, DEVICE)
    q = torch.randn(21, hq, dim, device=DEVICE)
    k = torch.randn(21, hkv, dim, device=DEVICE)
    v = torch.randn(21, hkv, dim, device=DEVICE)
    out = backend.forward(q, k, v, kc, vc, meta, dim ** -0.5)
    assert torch.equal(kc[3 * BLOCK:3 * BLOCK + 16], k[:16]) and torch.equal(kc[5 * BLOCK:5 * BLOCK + 4], k[16:20])
    assert torch.equal(vc[6 * BLOCK], v[20])
    ref = torch.nn.functional.scaled_dot_product_attention(
        q[:20].transpose(0, 1), k[:20].repeat_interleave(2, 1).transpose(0, 1),
        v[:20].repeat_interleave(2, 1).transpose(0, 1), is_causal=True).transpose(0, 1)
    torch.testing.assert_close(out[:20], ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out[20], v[20].repeat_interleave(2, 0))  # one key: its value
