"""The GPU attention backend: new keys/values written into the paged cache, then one Triton kernel
launch for every query row of the step (attention/triton_kernels.py)."""

from __future__ import annotations

import torch

from ruvllm.attention.kv_quant import KVTier
from ruvllm.attention.metadata import AttentionMetadata, build_paged_kernel_metadata

# Rows (token x query head) one program takes: enough for a tensor-core tile on prompts, few
# enough that a decode's mostly empty tile costs little.
_ROWS_PER_TILE = 64
# Keys per inner step. Fixed for every launch: a row's arithmetic must not depend on the step.
_KEYS_PER_STEP = 64


def _next_pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()


class TritonPagedAttention:
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
        from ruvllm.attention import triton_kernels  # imports triton; only when this backend is chosen

        self._kernel = triton_kernels.paged_attention_kernel
        self.group = num_heads // num_kv_heads
        self.group_pad = _next_pow2(self.group)
        self.tile_tokens = max(1, _ROWS_PER_TILE // self.group_pad)
        if self.tile_tokens * self.group_pad < 16:  # tl.dot needs 16 rows
            self.tile_tokens = 16 // self.group_pad
        self.head_dim = head_dim
        self.head_dim_pad = max(16, _next_pow2(head_dim))

    def build_metadata(self, seqs: list[tuple[int, int, list[int]]], block_size: int,
                       device: torch.device | str, tier: KVTier | None = None, window: int = 0) -> AttentionMetadata:
        if tier is not None:  # (EngineCore refuses the setting earlier, with the reason)
            raise ValueError("the Triton attention kernel reads no quantized KV blocks")
        return build_paged_kernel_metadata(seqs, block_size, device, tile_tokens=self.tile_tokens, window=window)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        k_cache.index_copy_(0, meta.slot_mapping, k)
        v_cache.index_copy_(0, meta.slot_mapping, v)
        out = torch.empty_like(q)
        self.launch(q, k_cache, v_cache, out, meta, scale)
        return out

    def launch(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor,
               meta: AttentionMetadata, scale: float) -> None:
        if q.stride(-1) != 1 or k_cache.stride(-1) != 1 or k_cache.stride() != v_cache.stride():
            raise ValueError("attention wants the head dimension contiguous and K/V caches of one layout")
        num_kv_heads = k_cache.shape[1]
        grid = (meta.num_tiles, num_kv_heads)
        self._kernel[grid](
            q, k_cache, v_cache, out,
            meta.block_tables, meta.row_ctx, meta.tile_seq, meta.tile_start, meta.tile_len,
            scale, meta.window,
            q.stride(0), q.stride(1), out.stride(0), out.stride(1), k_cache.stride(0), k_cache.stride(1),
            meta.block_tables.stride(0),
            GROUP=self.group, GROUP_PAD=self.group_pad, TOKENS=self.tile_tokens,
            HEAD_DIM=self.head_dim, HEAD_DIM_PAD=self.head_dim_pad,
            BLOCK_SIZE=meta.block_size, BLOCK_N=_KEYS_PER_STEP,
            IEEE=q.dtype == torch.float32,
        )
