"""The attention-backend interface: write this step's keys/values into the paged cache, attend."""

from __future__ import annotations

from typing import Protocol

import torch

from ruvllm.attention.kv_quant import ColdLayer, KVTier
from ruvllm.attention.metadata import AttentionMetadata


class AttentionBackend(Protocol):
    def build_metadata(
        self,
        seqs: list[tuple[int, int, list[int]]],  # (query tokens, context length after the step, block table)
        block_size: int,
        device: torch.device | str,
        tier: KVTier | None = None,  # a two-tier (quantized) KV cache; backends without it refuse one
        window: int = 0,  # sliding-window layers: keys a query sees, itself included (0: all)
    ) -> AttentionMetadata:  # built once per step and KV group, shared by the group's layers
        ...

    def forward(
        self,
        q: torch.Tensor,  # [T, Hq, D]
        k: torch.Tensor,  # [T, Hkv, D]
        v: torch.Tensor,  # [T, Hkv, D]
        k_cache: torch.Tensor,  # [num_slots, Hkv, D], slot = block * block_size + offset
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        cold: ColdLayer | None = None,  # this layer's cold KV tier, with meta.tier
    ) -> torch.Tensor:  # [T, Hq, D]
        ...
