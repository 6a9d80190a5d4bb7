"""Reference attention over the paged cache in plain PyTorch (CPU; also the oracle for GPU kernels)."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from ruvllm.attention.metadata import AttentionMetadata, build_attention_metadata, build_paged_kernel_metadata


class TorchPagedAttention:
    """With `kernel` (our compiled CPU kernel, attention/csrc): every query row, decode or prompt,
    in one call that reads the paged cache in place, each row computed the same way however the
    step was composed. Without it (no compiler): prompt chunks in one SDPA call each over their
    gathered context, decodes as two batched matmuls over keys gathered block by block."""

    def __init__(self, kernel: Callable[..., torch.Tensor] | None = None) -> None:
        self.kernel = kernel

    def build_metadata(self, seqs: list[tuple[int, int, list[int]]], block_size: int,
                       device: torch.device | str) -> AttentionMetadata:
        """The step's metadata in the form this backend reads (the kernel needs no gathers or masks)."""
        build = build_paged_kernel_metadata if self.kernel is not None else build_attention_metadata
        return build(seqs, block_size, device)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        k_cache.index_copy_(0, meta.slot_mapping, k)
        v_cache.index_copy_(0, meta.slot_mapping, v)
        if self.kernel is not None:
            return self.kernel(q.contiguous(), k_cache, v_cache, meta.block_tables, meta.row_seq, meta.row_ctx,
                               meta.block_size, scale)
        out = torch.empty_like(q)
        gqa = q.shape[1] != k.shape[1]
        if meta.decode_rows is not None:
            kd = _gather_blocks(k_cache, meta.decode_block_tables, meta.block_size)
            vd = _gather_blocks(v_cache, meta.decode_block_tables, meta.block_size)
            od = _decode_attention(q.index_select(0, meta.decode_rows), kd, vd, meta.decode_mask, scale)
            out.index_copy_(0, meta.decode_rows, od)
        for p in meta.prefills:
            qp = q[p.token_start:p.token_end].transpose(0, 1)  # [H, n, D]
            kp = k_cache[p.context_slots].transpose(0, 1)
            vp = v_cache[p.context_slots].transpose(0, 1)
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
