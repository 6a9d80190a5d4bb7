"""Reference attention over the paged cache in plain PyTorch (CPU; also the oracle for GPU kernels)."""

from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace

import torch
import torch.nn.functional as F

from ruvllm.attention.kv_quant import ColdLayer, KVTier, dequantize_rows, fake_quantize, quantize_rows
from ruvllm.attention.metadata import (AttentionMetadata, ColdGather, build_attention_metadata,
                                       build_paged_kernel_metadata)


class TorchPagedAttention:
    """With `kernel` (our compiled CPU kernel, attention/csrc): every query row, decode or prompt,
    in one call that reads the paged cache in place, each row computed the same way however the
    step was composed. Without it (no compiler): prompt chunks in one SDPA call each over their
    gathered context, decodes as two batched matmuls over keys gathered block by block.

    With a quantized KV cache (a `cold` layer store and `meta.tier`), `cold_kernels` (the same
    extension's tiered attention and quantize-copy) or, without them, PyTorch ops read cold blocks
    dequantized and hot blocks that are old for a query fake-quantized (kv_quant.py)."""

    def __init__(self, kernel: Callable[..., torch.Tensor] | None = None,
                 cold_kernels: SimpleNamespace | None = None) -> None:
        self.kernel = kernel
        self.cold_kernels = cold_kernels if kernel is not None else None

    def build_metadata(self, seqs: list[tuple[int, int, list[int]]], block_size: int,
                       device: torch.device | str, tier: KVTier | None = None, window: int = 0) -> AttentionMetadata:
        """The step's metadata in the form this backend reads (the kernel needs no gathers or masks)."""
        if self.kernel is not None:
            meta = build_paged_kernel_metadata(seqs, block_size, device, window=window)
            meta.tier = tier
            return meta
        return build_attention_metadata(seqs, block_size, device, tier, window)

    def quantize_blocks(self, kv_cache: torch.Tensor, src_slots: torch.Tensor, codes: torch.Tensor,
                        meta: torch.Tensor, dst_slots: torch.Tensor, bits: int) -> None:
        """Quantize-copy hot slots into cold slots, every layer and K and V at once: kv_cache
        [L, 2, hot_slots, Hkv, D] -> codes/meta [L, 2, cold_slots, Hkv, *]. The reads of this path
        (dequantize, fake-quantize) pair with its own quantizer."""
        if self.cold_kernels is not None:
            self.cold_kernels.quantize(kv_cache, src_slots, codes, meta, dst_slots, bits)
            return
        c, m = quantize_rows(kv_cache[:, :, src_slots], bits)
        codes[:, :, dst_slots] = c
        meta[:, :, dst_slots] = m

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                cold: ColdLayer | None = None) -> torch.Tensor:
        k_cache.index_copy_(0, meta.slot_mapping, k)
        v_cache.index_copy_(0, meta.slot_mapping, v)
        tier = meta.tier if cold is not None else None
        if self.kernel is not None:
            if tier is not None:
                if self.cold_kernels is None:
                    raise RuntimeError("the compiled kernel was given a quantized KV cache without its cold-tier kernels")
                return self.cold_kernels.attention(
                    q.contiguous(), k_cache, v_cache, cold.k_codes, cold.v_codes, cold.k_meta, cold.v_meta,
                    meta.block_tables, meta.row_seq, meta.row_ctx, meta.block_size, scale,
                    tier.num_hot_blocks, tier.hot_tokens, tier.bits)
            return self.kernel(q.contiguous(), k_cache, v_cache, meta.block_tables, meta.row_seq, meta.row_ctx,
                               meta.block_size, scale, meta.window)
        out = torch.empty_like(q)
        gqa = q.shape[1] != k.shape[1]
        bs = meta.block_size
        if meta.decode_rows is not None:
            if tier is None:
                kd = _gather_blocks(k_cache, meta.decode_block_tables, bs)
                vd = _gather_blocks(v_cache, meta.decode_block_tables, bs)
            else:
                kd = _gather_tiered(k_cache, cold.k_codes, cold.k_meta, meta.decode_cold, bs, tier, True)
                vd = _gather_tiered(v_cache, cold.v_codes, cold.v_meta, meta.decode_cold, bs, tier, True)
                kd, vd = (x.flatten(1, 2).transpose(1, 2) for x in (kd, vd))
            od = _decode_attention(q.index_select(0, meta.decode_rows), kd, vd, meta.decode_mask, scale)
            out.index_copy_(0, meta.decode_rows, od)
        for p in meta.prefills:
            qp = q[p.token_start:p.token_end].transpose(0, 1)  # [H, n, D]
            if p.cold is None:
                kp = k_cache[p.context_slots].transpose(0, 1)
                vp = v_cache[p.context_slots].transpose(0, 1)
            else:
                kp, vp = (_prefill_keys(c, codes, m, p.cold, bs, tier, p.mask.shape[1])
                          for c, codes, m in ((k_cache, cold.k_codes, cold.k_meta), (v_cache, cold.v_codes, cold.v_meta)))
            op = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=p.mask, is_causal=p.mask is None,
                                                scale=scale, enable_gqa=gqa)
            out[p.token_start:p.token_end] = op.transpose(0, 1)
        return out


def _decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                      scale: float) -> torch.Tensor:
    """One query per sequence: q [B, Hq, D], k/v [B, Hkv, ctx, D], mask [B, 1, 1, ctx] -> [B, Hq, D].

    Two batched matmuls with the query heads of a KV head stacked as rows. SDPA's CPU flash kernel
    tiles over queries and spends most of its time on tiles of one row (measured 2.7 ms vs ~0.3 ms
    per layer at 32 sequences; docs/performance.md)."""
    b, hq, d = q.shape
    hkv = k.shape[1]
    qg = q.view(b, hkv, hq // hkv, d)
    scores = torch.matmul(qg, k.transpose(-1, -2)).float() * scale  # [B, Hkv, G, ctx]
    scores.masked_fill_(~mask, float("-inf"))
    probs = scores.softmax(dim=-1).to(v.dtype)
    return torch.matmul(probs, v).view(b, hq, d)


def _gather_blocks(cache: torch.Tensor, tables: torch.Tensor, block_size: int) -> torch.Tensor:
    """[num_slots, H, D] cache, [B, nblk] tables -> [B, H, nblk * block_size, D] keys or values."""
    blocks = cache.view(-1, block_size, *cache.shape[1:])[tables]  # [B, nblk, bs, H, D]
    return blocks.flatten(1, 2).transpose(1, 2)


def _gather_tiered(cache: torch.Tensor, codes: torch.Tensor, meta: torch.Tensor, g: ColdGather, block_size: int,
                   tier: KVTier, fake_quantize_old: bool) -> torch.Tensor:
    """Blocks of a table over both tiers: [*table shape, bs, H, D] in the cache's dtype."""
    blocks = cache.view(-1, block_size, *cache.shape[1:])[g.hot_table]
    flat = blocks.view(-1, *blocks.shape[-3:])
    if g.cold_at.numel():
        c = codes.view(-1, block_size, *codes.shape[1:])[g.cold_ids]
        m = meta.view(-1, block_size, *meta.shape[1:])[g.cold_ids]
        flat[g.cold_at] = dequantize_rows(c, m, tier.bits).to(cache.dtype)
    if fake_quantize_old and g.fq_at.numel():
        flat[g.fq_at] = fake_quantize(flat[g.fq_at], tier.bits)
    return blocks


def _prefill_keys(cache: torch.Tensor, codes: torch.Tensor, meta: torch.Tensor, g: ColdGather, block_size: int,
                  tier: KVTier, num_keys: int) -> torch.Tensor:
    """A prompt chunk's context [H, keys, D]: its context_len keys as stored (cold ones
    dequantized), then fake-quantized copies of the hot blocks some of its rows read as old."""
    blocks = _gather_tiered(cache, codes, meta, g, block_size, tier, False).squeeze(0)  # [nblk, bs, H, D]
    ctx = num_keys - g.fq_at.numel() * block_size
    keys = blocks.flatten(0, 1)[:ctx]
    if g.fq_at.numel():
        keys = torch.cat([keys, fake_quantize(blocks[g.fq_at], tier.bits).flatten(0, 1)])
    return keys.transpose(0, 1)
