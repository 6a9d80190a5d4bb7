"""Sliding-window attention (Gemma 3's local layers) in every attention path: our C++ kernel (both
its fp32 fast walk and its generic walk), the PyTorch path's masks, and the Triton kernel (run by
Triton's interpreter on CPU), each against a float64 reference that sees only a row's last `window`
keys. The blocks wholly before the window of a sequence's first row are placeholders pointing at a
block of NaNs: the sliding KV group hands such blocks back to the pool, so reading one (or letting
it into a softmax) would show as NaN."""

from __future__ import annotations

import pytest
import torch

from ruvllm.attention.cpu_kernels import paged_attention
from ruvllm.attention.torch_paged import TorchPagedAttention
from tests.unit.paged_reference import BLOCK, SEQS, random_step, reference_attention

WINDOWS = [1, 5, 16, 33, 64, 1000]


def _poisoned_step(dtype: torch.dtype, hq: int, hkv: int, dim: int, window: int):
    """random_step's caches, with one more block of NaNs, and each table's blocks that no row of its
    sequence reads (wholly before the first row's window) pointed at it."""
    q, kc, vc, tables, row_seq, row_ctx = random_step(dtype, hq, hkv, dim)
    nan_block = kc.shape[0] // BLOCK
    pad = torch.full((BLOCK, hkv, dim), float("nan"), dtype=dtype)
    kc, vc = torch.cat([kc, pad]), torch.cat([vc, pad])
    for i, (start, _) in enumerate(SEQS):
        first_key = max(0, start + 1 - window)
        tables[i, : first_key // BLOCK] = nan_block
    return q, kc, vc, tables, row_seq, row_ctx


def _seq_lists(tables: torch.Tensor) -> list[tuple[int, int, list[int]]]:
    return [(n, start + n, tables[i].tolist()) for i, (start, n) in enumerate(SEQS)]


@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize(("dtype", "dim", "tol"), [(torch.float32, 64, 1e-5), (torch.float32, 40, 1e-5),
                                                   (torch.bfloat16, 64, 2e-2)])
def test_cpu_kernel(window: int, dtype: torch.dtype, dim: int, tol: float) -> None:
    """fp32 with a head size a multiple of 32 takes the kernel's fast walk; 40 and bf16 the generic one."""
    kernel = paged_attention()
    if kernel is None:
        pytest.skip("the C++ kernels did not build here")
    hq, hkv = 8, 2
    q, kc, vc, tables, row_seq, row_ctx = _poisoned_step(dtype, hq, hkv, dim, window)
    scale = dim ** -0.5
    ref = reference_attention(q, kc, vc, tables, row_seq, row_ctx, scale, window)
    out = kernel(q, kc, vc, tables, row_seq, row_ctx, BLOCK, scale, window)
    assert not out.isnan().any()
    assert (out.double() - ref).abs().max().item() < tol


def test_torch_path_matches_reference_without_poison() -> None:
    """The PyTorch path reads placeholder blocks under its masks (a gather is cheaper than skipping
    them), so it is checked on finite caches: the masks hide exactly the keys before the window."""
    hq, hkv, dim = 8, 2, 64
    for window in WINDOWS:
        q, kc, vc, tables, row_seq, row_ctx = random_step(torch.float32, hq, hkv, dim)
        ref = reference_attention(q, kc, vc, tables, row_seq, row_ctx, dim ** -0.5, window)
        backend = TorchPagedAttention(None)
        meta = backend.build_metadata(_seq_lists(tables), BLOCK, "cpu", window=window)
        meta.slot_mapping = torch.empty(0, dtype=torch.long)
        out = backend.forward(q, q[:0, :hkv], q[:0, :hkv], kc, vc, meta, dim ** -0.5)
        assert (out.double() - ref).abs().max().item() < 1e-5, window


@pytest.mark.parametrize("window", WINDOWS)
def test_triton_kernel(window: int) -> None:
    pytest.importorskip("triton")
    from ruvllm.attention.triton_paged import TritonPagedAttention

    device = "cuda" if torch.cuda.is_available() else "cpu"
    hq, hkv, dim = 8, 2, 64
    q, kc, vc, tables, row_seq, row_ctx = _poisoned_step(torch.float32, hq, hkv, dim, window)
    scale = dim ** -0.5
    ref = reference_attention(q, kc, vc, tables, row_seq, row_ctx, scale, window)
    backend = TritonPagedAttention(hq, hkv, dim)
    meta = backend.build_metadata(_seq_lists(tables), BLOCK, device, window=window)
    out = torch.full_like(q, float("nan")).to(device)
    backend.launch(q.to(device), kc.to(device), vc.to(device), out, meta, scale)
    assert not out.isnan().any()
    assert (out.cpu().double() - ref).abs().max().item() < 1e-5
