"""Attention metadata (slot mapping, gathers, masks) and TorchPagedAttention vs a dense reference."""

from __future__ import annotations

import math

import pytest
import torch

from ruvllm.attention.metadata import build_attention_metadata, build_paged_kernel_metadata
from ruvllm.attention.torch_paged import TorchPagedAttention

BS = 4


def test_slot_mapping_for_mixed_batch() -> None:
    seqs = [
        (3, 7, [5, 2]),  # prompt chunk: positions 4..6, 4 tokens of context before it
        (1, 6, [0, 9]),  # decode at position 5
        (5, 5, [3, 1, 8]),  # whole prompt of 5 tokens (third block not needed yet)
        (1, 1, [6]),  # decode of a 1-token context
    ]
    meta = build_attention_metadata(seqs, BS)
    assert meta.slot_mapping.tolist() == [8, 9, 10, 37, 12, 13, 14, 15, 4, 24]

    assert meta.decode_rows.tolist() == [3, 9]
    assert meta.decode_block_tables.tolist() == [[0, 9], [6, 0]]
    assert meta.decode_mask.shape == (2, 1, 1, 8)
    assert meta.decode_mask[:, 0, 0].tolist() == [[True] * 6 + [False] * 2, [True] + [False] * 7]

    assert len(meta.prefills) == 2
    p0, p1 = meta.prefills
    assert (p0.token_start, p0.token_end) == (0, 3)
    assert p0.context_slots.tolist() == [20, 21, 22, 23, 8, 9, 10]
    expect = torch.tensor([[j <= i for j in range(7)] for i in (4, 5, 6)])
    assert torch.equal(p0.mask, expect)
    assert (p1.token_start, p1.token_end) == (4, 9)
    assert p1.context_slots.tolist() == [12, 13, 14, 15, 4]
    assert p1.mask is None


def test_prefill_only_batch_has_no_decodes() -> None:
    meta = build_attention_metadata([(4, 4, [2]), (2, 6, [7, 1])], BS)
    assert meta.slot_mapping.tolist() == [8, 9, 10, 11, 4, 5]
    assert meta.decode_rows is None and meta.decode_block_tables is None and meta.decode_mask is None
    assert [(p.token_start, p.token_end) for p in meta.prefills] == [(0, 4), (4, 6)]


# ------------------------------------------------------------------------------- attention vs reference

HQ, HKV, D = 4, 2, 8


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: list[int], scale: float) -> torch.Tensor:
    """q [n, HQ, D] at positions q_pos, attending causally over k/v [ctx, HKV, D] (GQA: head h uses h // 2)."""
    group = HQ // HKV
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    ctx = k.shape[0]
    allowed = torch.tensor([[j <= p for j in range(ctx)] for p in q_pos])
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


@pytest.mark.parametrize("seed", [0, 1])
def test_torch_paged_attention_matches_dense_causal_reference(seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    num_blocks = 24
    # (num_query_tokens, context_len_after_step)
    shapes = [(3, 9), (1, 6), (5, 5), (1, 1), (6, 14), (1, 13)]
    perm = torch.randperm(num_blocks, generator=g).tolist()  # non-contiguous, shuffled block tables
    tables, used = [], 0
    for _, ctx in shapes:
        nb = -(-ctx // BS)
        tables.append(perm[used:used + nb])
        used += nb
    assert used <= num_blocks
    k_cache = torch.randn(num_blocks * BS, HKV, D, generator=g) * 10  # junk everywhere
    v_cache = torch.randn(num_blocks * BS, HKV, D, generator=g) * 10
    full_k = [torch.randn(ctx, HKV, D, generator=g) for _, ctx in shapes]
    full_v = [torch.randn(ctx, HKV, D, generator=g) for _, ctx in shapes]
    qs = [torch.randn(n, HQ, D, generator=g) for n, _ in shapes]
    # earlier steps wrote the prior context into the cache
    for (n, ctx), table, fk, fv in zip(shapes, tables, full_k, full_v):
        for pos in range(ctx - n):
            slot = table[pos // BS] * BS + pos % BS
            k_cache[slot] = fk[pos]
            v_cache[slot] = fv[pos]

    meta = build_attention_metadata([(n, ctx, t) for (n, ctx), t in zip(shapes, tables)], BS)
    q = torch.cat(qs)
    k = torch.cat([fk[ctx - n:] for (n, ctx), fk in zip(shapes, full_k)])
    v = torch.cat([fv[ctx - n:] for (n, ctx), fv in zip(shapes, full_v)])
    scale = 1 / math.sqrt(D)
    out = TorchPagedAttention().forward(q, k, v, k_cache, v_cache, meta, scale)

    assert out.shape == q.shape
    row = 0
    for (n, ctx), qq, fk, fv, table in zip(shapes, qs, full_k, full_v, tables):
        ref = reference(qq, fk, fv, list(range(ctx - n, ctx)), scale)
        torch.testing.assert_close(out[row:row + n], ref, rtol=1e-5, atol=1e-5)
        # the new keys/values landed in their slots
        for i, pos in enumerate(range(ctx - n, ctx)):
            slot = table[pos // BS] * BS + pos % BS
            assert torch.equal(k_cache[slot], fk[pos]) and torch.equal(v_cache[slot], fv[pos])
        row += n


def test_kernel_metadata_rows_and_slots() -> None:
    # A decode at position 5 (table [2, 3]), then a 3-token chunk at positions 7..9 across a block
    # boundary (table [7, 1, 9]): each row's sequence, its context length, and the slot written.
    meta = build_paged_kernel_metadata([(1, 6, [2, 3]), (3, 10, [7, 1, 9, 4])], BS)
    assert meta.row_seq.tolist() == [0, 1, 1, 1]
    assert meta.row_ctx.tolist() == [6, 8, 9, 10]
    assert meta.slot_mapping.tolist() == [3 * BS + 1, 1 * BS + 3, 9 * BS + 0, 9 * BS + 1]
    assert meta.block_tables.tolist() == [[2, 3, 0], [7, 1, 9]]  # only the blocks the context uses, padded
