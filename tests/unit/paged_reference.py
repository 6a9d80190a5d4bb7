"""Random paged caches and a float64 attention reference, shared by the attention-kernel tests."""

from __future__ import annotations

import torch

BLOCK = 16
# (first position of this step's rows, number of rows): decodes, prompt chunks behind a cached or
# earlier-chunked prefix, a whole prompt, a one-token context, and a chunk longer than one tile.
SEQS = [(36, 1), (10, 20), (0, 5), (0, 1), (47, 1), (3, 40), (70, 70)]


def random_step(dtype: torch.dtype, hq: int, hkv: int, dim: int = 64, seed: int = 0, seqs=SEQS):
    """q [T, Hq, D], K/V caches with scattered non-monotonic blocks, block tables [S, max_blocks],
    and per row its sequence and context length."""
    g = torch.Generator().manual_seed(seed)
    num_blocks = 64
    k_cache = torch.randn(num_blocks * BLOCK, hkv, dim, generator=g).to(dtype)
    v_cache = torch.randn(num_blocks * BLOCK, hkv, dim, generator=g).to(dtype)
    free = torch.randperm(num_blocks, generator=g).tolist()
    tables, row_seq, row_ctx = [], [], []
    for i, (start, n) in enumerate(seqs):
        nblk = (start + n + BLOCK - 1) // BLOCK
        tables.append([free.pop() for _ in range(nblk)])
        row_seq += [i] * n
        row_ctx += list(range(start + 1, start + n + 1))
    width = max(len(t) for t in tables)
    tables_t = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    q = torch.randn(len(row_seq), hq, dim, generator=g).to(dtype)
    return q, k_cache, v_cache, tables_t, torch.tensor(row_seq), torch.tensor(row_ctx)


def reference_attention(q, k_cache, v_cache, tables, row_seq, row_ctx, scale, window=0):
    """Row by row in float64; with `window`, a row sees only its last `window` keys."""
    out = torch.empty(q.shape, dtype=torch.float64)
    group = q.shape[1] // k_cache.shape[1]
    for r in range(q.shape[0]):
        ctx = int(row_ctx[r])
        pos = torch.arange(max(0, ctx - window) if window else 0, ctx)
        slots = tables[row_seq[r]][pos // BLOCK] * BLOCK + pos % BLOCK
        k = k_cache[slots.cpu()].double().cpu().repeat_interleave(group, dim=1)  # [ctx, Hq, D]
        v = v_cache[slots.cpu()].double().cpu().repeat_interleave(group, dim=1)
        p = (torch.einsum("hd,thd->ht", q[r].double().cpu(), k) * scale).softmax(-1)
        out[r] = torch.einsum("ht,thd->hd", p, v)
    return out
