"""Preallocated adapter slots: every layer's LoRA weights for `max_loras` adapters at `max_rank`,
laid out per fused projection as the kernel reads them (lora/csrc/lora_add.cpp). Loading an adapter
is a copy into a slot, never an allocation; rows past a slot's rank are never read (the kernel and
the PyTorch path both stop at it), so they need no zeroing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ruvllm.config import ModelConfig
from ruvllm.lora.peft_adapter import LoraAdapter, projection_shape

# Our fused projections and the Hugging Face projections inside each, in output order.
FUSED = {"qkv": ("q_proj", "k_proj", "v_proj"), "o": ("o_proj",), "gate_up": ("gate_proj", "up_proj"),
         "down": ("down_proj",)}


@dataclass
class ProjectionSlots:
    """One fused projection of one layer, for every slot."""

    A: torch.Tensor  # [S, n_sub * R, K]
    B: torch.Tensor  # [S, R, N], scaling folded in
    ranks: torch.Tensor  # [S, n_sub] int32, on the CPU (the kernel and the fallback read it there)
    bounds: tuple[int, ...]  # output columns of each sub-projection: bounds[i] .. bounds[i + 1]


class LoraSlots:
    def __init__(self, cfg: ModelConfig, max_loras: int, max_rank: int, dtype: torch.dtype,
                 device: torch.device | str = "cpu") -> None:
        self.cfg, self.max_loras, self.max_rank = cfg, max_loras, max_rank
        self._flat: tuple[list[torch.Tensor], list[int]] | None = None
        self.layers: list[dict[str, ProjectionSlots]] = []
        for _ in range(cfg.num_layers):
            layer = {}
            for fused, subs in FUSED.items():
                k = projection_shape(cfg, subs[0])[0]
                widths = [projection_shape(cfg, t)[1] for t in subs]
                bounds = tuple(sum(widths[:i]) for i in range(len(widths) + 1))
                layer[fused] = ProjectionSlots(
                    torch.zeros(max_loras, len(subs) * max_rank, k, dtype=dtype, device=device),
                    torch.zeros(max_loras, max_rank, bounds[-1], dtype=dtype, device=device),
                    torch.zeros(max_loras, len(subs), dtype=torch.int32), bounds)
            self.layers.append(layer)

    def flat(self) -> tuple[list[torch.Tensor], list[int]]:
        """What the C++ layer loop takes: each layer's A, B and ranks of qkv, o, gate_up and down in
        that order, and the four projections' output bounds one after the other (the same in every
        layer). The tensors are the slots themselves, so one list serves every step."""
        if self._flat is None:
            tensors = [t for layer in self.layers for f in FUSED for t in (layer[f].A, layer[f].B, layer[f].ranks)]
            bounds = [b for f in FUSED for b in self.layers[0][f].bounds]
            self._flat = (tensors, bounds)
        return self._flat

    @property
    def nbytes(self) -> int:
        return sum(p.A.numel() * p.A.element_size() + p.B.numel() * p.B.element_size()
                   for layer in self.layers for p in layer.values())

    def clear(self, slot: int) -> None:
        """Empty a slot. Its rank rows are left as they are: nothing reads past a slot's ranks."""
        for layer in self.layers:
            for p in layer.values():
                p.ranks[slot] = 0

    def load(self, slot: int, adapter: LoraAdapter) -> None:
        """Copy an adapter (checked against this model by load_peft_adapter) into a slot."""
        if adapter.rank > self.max_rank:
            raise ValueError(f"adapter rank {adapter.rank} over the slots' {self.max_rank}")
        self.clear(slot)
        R = self.max_rank
        for (layer, target), (a, b) in adapter.weights.items():
            fused = next(f for f, subs in FUSED.items() if target in subs)
            p, i = self.layers[layer][fused], FUSED[fused].index(target)
            r = a.shape[0]
            p.A[slot, i * R:i * R + r].copy_(a)
            p.B[slot, :r, p.bounds[i]:p.bounds[i + 1]].copy_(b.t())
            p.ranks[slot, i] = r
