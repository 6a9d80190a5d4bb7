"""Paged attention as one Triton kernel: every query row of a step (prompt chunks with or without a
cached prefix, and decodes) reads its keys and values through the block table, in place.

Imported only where Triton is wanted (CUDA, or the interpreter in tests): `triton.jit` decides at
import whether kernels are compiled or interpreted (TRITON_INTERPRET).

One program takes a tile of consecutive query tokens of one sequence and one KV head; its rows are
(token, query head of that KV head's group) pairs, so the query heads sharing a KV head share each
key/value load and the scores are a matrix product on the tensor cores, for decodes as for prompts.
Every row walks its keys in the same fixed-size steps from key 0 (a sliding-window layer starts at
the step holding the tile's first visible key), and a step past a row's last key, or wholly before
its window, leaves its running max, sum and output exactly unchanged: a row's result never depends on which
other rows, tokens or sequences shared its tile or its step (batch invariance by construction).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def paged_attention_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr,
    block_tables_ptr, row_ctx_ptr, tile_seq_ptr, tile_start_ptr, tile_len_ptr,
    scale, window,  # window > 0: a row sees only its last `window` keys (a sliding-window layer)
    stride_qt, stride_qh, stride_ot, stride_oh, stride_cs, stride_ch, stride_bt,
    GROUP: tl.constexpr,  # query heads per KV head
    GROUP_PAD: tl.constexpr,  # GROUP rounded up to a power of two
    TOKENS: tl.constexpr,  # query tokens per tile
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,  # tokens per KV cache block
    BLOCK_N: tl.constexpr,  # keys per inner step (a multiple of BLOCK_SIZE)
    IEEE: tl.constexpr,  # fp32 models: exact fp32 products, not tf32
):
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = tl.load(tile_seq_ptr + tile)
    first = tl.load(tile_start_ptr + tile)
    count = tl.load(tile_len_ptr + tile)

    BLOCK_M: tl.constexpr = TOKENS * GROUP_PAD
    rows = tl.arange(0, BLOCK_M)
    tok = rows // GROUP_PAD
    head = kv_head * GROUP + rows % GROUP_PAD
    row_ok = (tok < count) & (rows % GROUP_PAD < GROUP)
    flat = first + tok
    # Keys a row may see: its position + 1. Padding rows see key 0 only, so no row is ever all -inf.
    ctx = tl.load(row_ctx_ptr + flat, mask=row_ok, other=1)
    ctx_max = tl.load(row_ctx_ptr + first + count - 1)
    lo = tl.where(window > 0, ctx - window, 0)  # a row's first visible key (may be < 0)
    ctx_min = tl.load(row_ctx_ptr + first)
    lo_min = tl.maximum(tl.where(window > 0, ctx_min - window, 0), 0)

    d = tl.arange(0, HEAD_DIM_PAD)
    d_ok = d < HEAD_DIM
    q = tl.load(q_ptr + flat[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], tl.float32)
    qk_scale = scale * 1.4426950408889634  # softmax in base 2: exp(x) = exp2(x * log2(e))
    keys = tl.arange(0, BLOCK_N)
    table = block_tables_ptr + seq * stride_bt
    for start in range(lo_min // BLOCK_N * BLOCK_N, ctx_max, BLOCK_N):
        n = start + keys
        n_ok = (n < ctx_max) & (n >= lo_min)  # keys before the tile's window may sit in placeholder blocks
        block = tl.load(table + n // BLOCK_SIZE, mask=n_ok, other=0)
        slot = block.to(tl.int64) * BLOCK_SIZE + n % BLOCK_SIZE
        kv_off = slot[:, None] * stride_cs + kv_head * stride_ch + d[None, :]
        kv_mask = n_ok[:, None] & d_ok[None, :]
        k = tl.load(k_cache_ptr + kv_off, mask=kv_mask, other=0.0)
        v = tl.load(v_cache_ptr + kv_off, mask=kv_mask, other=0.0)
        if IEEE:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        s = s * qk_scale
        s = tl.where((n[None, :] < ctx[:, None]) & (n[None, :] >= lo[:, None]), s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        # A row that has seen no key yet (a step before its window) stays as it was: no inf - inf.
        seen = m_new > float("-inf")
        alpha = tl.where(seen, tl.exp2(m_i - m_new), 1.0)
        p = tl.where(seen[:, None], tl.exp2(s - m_new[:, None]), 0.0)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    out = acc / l_i[:, None]
    tl.store(out_ptr + flat[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
