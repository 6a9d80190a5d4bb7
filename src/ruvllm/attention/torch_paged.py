"""Reference attention over the paged cache in plain PyTorch (CPU; also the oracle for GPU kernels)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ruvllm.attention.metadata import AttentionMetadata


class TorchPagedAttention:
    """Decodes attend in one padded SDPA call; prompt chunks one SDPA call each."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        k_cache.index_copy_(0, meta.slot_mapping, k)
        v_cache.index_copy_(0, meta.slot_mapping, v)
        out = torch.empty_like(q)
        gqa = q.shape[1] != k.shape[1]
        if meta.decode_rows is not None:
            # [B, H, 1, D] queries against [B, Hkv, ctx, D] gathered keys; padding masked out.
            qd = q.index_select(0, meta.decode_rows).unsqueeze(2)
            kd = k_cache[meta.decode_slots].transpose(1, 2)
            vd = v_cache[meta.decode_slots].transpose(1, 2)
            od = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=meta.decode_mask, scale=scale,
                                                enable_gqa=gqa)
            out.index_copy_(0, meta.decode_rows, od.squeeze(2))
        for p in meta.prefills:
            qp = q[p.token_start:p.token_end].transpose(0, 1)  # [H, n, D]
            kp = k_cache[p.context_slots].transpose(0, 1)
            vp = v_cache[p.context_slots].transpose(0, 1)
            op = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=p.mask, is_causal=p.mask is None,
                                                scale=scale, enable_gqa=gqa)
            out[p.token_start:p.token_end] = op.transpose(0, 1)
        return out
