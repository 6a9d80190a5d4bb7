"""One step's adapters: which slot each row of the flat batch uses, and the delta each fused
projection adds for those rows (the base matmul has already run for every row)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ruvllm.lora.slots import LoraSlots, ProjectionSlots


def lora_kernel() -> Callable[..., None] | None:
    """Our C++ kernel (CPU, float32), or None when the kernels cannot be built."""
    from ruvllm.cpu_build import kernels

    ext = kernels()
    return None if ext is None else ext.lora_add


def lora_add_torch(y: torch.Tensor, x: torch.Tensor, p: ProjectionSlots, row_slot: list[int],
                   row_weight: torch.Tensor | None = None) -> None:
    """The kernel's computation in PyTorch ops, for any device and dtype: per slot, its rows'
    shrink and expand (one matmul each per sub-projection), the shrink scaled by `row_weight`
    [T, n_sub] when given. The reference for the kernel's tests; unlike the kernel, its matmuls may
    round a row differently with the group's size."""
    R = p.B.shape[1]
    for s in sorted(set(row_slot) - {-1}):
        idx = torch.tensor([t for t, v in enumerate(row_slot) if v == s], device=x.device)
        xs = x.index_select(0, idx)
        for i, r in enumerate(p.ranks[s].tolist()):
            if r == 0:
                continue
            lo, hi = p.bounds[i], p.bounds[i + 1]
            u = xs @ p.A[s, i * R:i * R + r].t()
            if row_weight is not None:
                u = u * row_weight.index_select(0, idx)[:, i:i + 1].to(u.dtype)
            y[idx, lo:hi] += u @ p.B[s, :r, lo:hi]


@dataclass
class LoraBatch:
    """A step's adapters: per level, each row's slot. Level 0 holds each row's adapter (its named
    one, or its tenant's learned micro-LoRA when it names none); level 1 a stacked row's micro-LoRA
    on top of its named adapter (-1 for every other row). The deltas are added level by level, so a
    stacked row's output is y + d_named + d_micro in that order, whatever else shares the batch."""

    slots: LoraSlots
    row_slot: list[int]  # level 0: per row of the flat batch, the adapter slot, or -1 for the base model
    kernel: Callable[..., None] | None = None
    stacked: list[list[int]] = field(default_factory=list)  # levels 1..: the same, for stacked adapters

    def __post_init__(self) -> None:
        levels = [self.row_slot, *self.stacked]
        # [T] for one level (as always), [D, T] for stacks: the kernel adds level by level
        self.rows = torch.tensor(levels if self.stacked else self.row_slot, dtype=torch.int32)

    @property
    def in_layer_loop(self) -> bool:
        """Whether the C++ layer loop can apply these deltas (it calls our kernel itself)."""
        return self.kernel is not None

    def add(self, layer: int, fused: str, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """y (the base projection of x) plus each row's adapter delta, in place."""
        p = self.slots.layers[layer][fused]
        if self.kernel is not None and _kernel_takes(x, y):
            self.kernel(y, x, p.A, p.B, p.ranks, self.rows, list(p.bounds))
        else:
            for level in (self.row_slot, *self.stacked):
                lora_add_torch(y, x, p, level)
        return y


def _kernel_takes(x: torch.Tensor, y: torch.Tensor) -> bool:
    return y.device.type == "cpu" and y.dtype == torch.float32 and x.is_contiguous() and y.is_contiguous()


@dataclass
class XLoraBatch:
    """The real pass of X-LoRA rows: each row mixes its model's adapters by its own scalings.

    member_slots[k][t] is the slot of row t's k-th adapter (-1 when its model has fewer);
    weights[(layer, fused projection)] [k, T, n_sub] holds each row's scaling of its k-th adapter in
    each sub-projection (global_scaling_weight folded in). A row's deltas are added adapter by adapter in
    its model's order, whatever else the batch holds."""

    slots: LoraSlots
    member_slots: list[list[int]]
    weights: dict[tuple[int, str], torch.Tensor]
    kernel: Callable[..., None] | None = None
    # Adapters stacked on the mixture (a tenant's learned micro-LoRA): per level, each row's slot
    # (-1: none), added after every expert's delta, unweighted.
    stacked: list[list[int]] = field(default_factory=list)

    in_layer_loop = False  # the C++ loop takes one adapter per row: the Python loop runs these steps

    def __post_init__(self) -> None:
        self.rows = [torch.tensor(r, dtype=torch.int32) for r in self.member_slots]
        self.stacked_rows = torch.tensor(self.stacked, dtype=torch.int32) if self.stacked else None

    def add(self, layer: int, fused: str, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        p = self.slots.layers[layer][fused]
        w = self.weights[(layer, fused)]
        for k, (rows, row_slot) in enumerate(zip(self.rows, self.member_slots)):
            if self.kernel is not None and _kernel_takes(x, y):
                self.kernel(y, x, p.A, p.B, p.ranks, rows, list(p.bounds), w[k])
            else:
                lora_add_torch(y, x, p, row_slot, w[k])
        if self.stacked_rows is not None:
            if self.kernel is not None and _kernel_takes(x, y):
                self.kernel(y, x, p.A, p.B, p.ranks, self.stacked_rows, list(p.bounds))
            else:
                for level in self.stacked:
                    lora_add_torch(y, x, p, level)
        return y
