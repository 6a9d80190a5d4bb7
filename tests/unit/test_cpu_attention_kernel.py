"""The compiled paged-attention kernel: every query row against a float64 reference on random
caches, and each row's bits independent of what else is in the call (the basis of batch, chunking
and preemption invariance at the default precision)."""

from __future__ import annotations

import pytest
import torch

from ruvllm.attention.cpu_kernels import cold_tier_kernels, paged_attention
from tests.unit.paged_reference import BLOCK, random_step, reference_attention

kernel = paged_attention()
pytestmark = pytest.mark.skipif(kernel is None, reason="no C++ compiler to build the kernel")

@pytest.mark.parametrize(("hq", "hkv"), [(9, 3), (4, 4), (8, 1)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_matches_reference(dtype: torch.dtype, hq: int, hkv: int) -> None:
    q, kc, vc, tables, row_seq, row_ctx = random_step(dtype, hq, hkv)
    scale = q.shape[-1] ** -0.5
    out = kernel(q, kc, vc, tables, row_seq, row_ctx, BLOCK, scale)
    assert out.dtype == dtype and out.shape == q.shape
    tol = 1e-5 if dtype == torch.float32 else 1.6e-2  # bf16: one rounding of outputs of magnitude ~1
    torch.testing.assert_close(out.double(), reference_attention(q, kc, vc, tables, row_seq, row_ctx, scale),
                               atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_each_row_is_the_same_alone_or_in_any_company(dtype: torch.dtype) -> None:
    q, kc, vc, tables, row_seq, row_ctx = random_step(dtype, 9, 3, seed=1)
    together = kernel(q, kc, vc, tables, row_seq, row_ctx, BLOCK, 0.125)
    for r in range(q.shape[0]):  # each row as a lone decode
        s = int(row_seq[r])
        alone = kernel(q[r:r + 1].contiguous(), kc, vc, tables[s:s + 1], torch.tensor([0]), row_ctx[r:r + 1],
                       BLOCK, 0.125)
        assert torch.equal(alone, together[r:r + 1]), r
    # A prompt chunk split in two calls (chunked prefill) gives the bits of one call.
    rows = (row_seq == 5).nonzero().flatten()
    a, b = rows[:7], rows[7:]
    parts = [kernel(q[i].contiguous(), kc, vc, tables[5:6], torch.zeros(len(i), dtype=torch.long), row_ctx[i],
                    BLOCK, 0.125) for i in (a, b)]
    assert torch.equal(torch.cat(parts), together[rows])


# Query heads per KV head: 3, 8 (4 + 4), 2, 4, 7 (4 + 3), 6 (4 + 2), 1, and 48 not a multiple of 32.
@pytest.mark.parametrize(("hq", "hkv", "dim"), [(9, 3, 64), (8, 1, 64), (4, 2, 128), (8, 2, 64), (7, 1, 64),
                                                (12, 2, 32), (4, 4, 64), (4, 2, 48)])
def test_fp32_row_walk_is_the_generic_walk(hq: int, hkv: int, dim: int) -> None:
    """fp32 caches without a cold tier take a faster walk (a KV head's query heads scored against a
    few keys at a time, values weighed in registers) when the head size is a multiple of 32; its
    arithmetic is the generic walk's, which the tiered entry point runs: with nothing cold, the two
    give the same bits."""
    tiered = cold_tier_kernels().attention
    q, kc, vc, tables, row_seq, row_ctx = random_step(torch.float32, hq, hkv, dim=dim, seed=2)
    fast = kernel(q, kc, vc, tables, row_seq, row_ctx, BLOCK, 0.125)
    codes = torch.zeros(BLOCK, hkv, dim, dtype=torch.int8)
    meta = torch.zeros(BLOCK, hkv, 1, dtype=torch.float16)
    generic = tiered(q, kc, vc, codes, codes, meta, meta, tables, row_seq, row_ctx, BLOCK, 0.125,
                     kc.shape[0] // BLOCK, 10**6, 8)  # every block hot, none old for any row
    assert torch.equal(fast, generic)


def test_kernel_rejects_bad_input() -> None:
    q, kc, vc, tables, row_seq, row_ctx = random_step(torch.float32, 4, 2)
    with pytest.raises(RuntimeError, match="share a dtype"):
        kernel(q.bfloat16(), kc, vc, tables, row_seq, row_ctx, BLOCK, 0.125)
    with pytest.raises(RuntimeError, match="int64"):
        kernel(q, kc, vc, tables.int(), row_seq, row_ctx, BLOCK, 0.125)
    with pytest.raises(RuntimeError, match="multiple of KV heads"):
        kernel(q[:, :3].contiguous(), kc, vc, tables, row_seq, row_ctx, BLOCK, 0.125)
    with pytest.raises(RuntimeError, match="block table holds"):
        kernel(q, kc, vc, tables, row_seq, row_ctx + 10_000, BLOCK, 0.125)
    with pytest.raises(RuntimeError, match="one sequence and context per row"):
        kernel(q, kc, vc, tables, row_seq[:-1], row_ctx, BLOCK, 0.125)
