"""KV groups: which layers share a block table, and how far back each group's queries look.

A model whose layers all attend to the whole context has one group. Gemma 3 interleaves sliding-
window layers (a query sees only the last `window` keys) with global ones. Their K/V live in one
pool of blocks, as in vLLM's hybrid allocator: layers are put in groups of equal size (the smaller
kind's count), a block holds one block's worth of tokens for every layer of one group, and each
group has its own block table per request. A sliding group's table keeps only the blocks inside
the window; older ones go back to the pool as the request moves on (docs/gemma3.md).

Torch-free: the core's KV cache manager and the worker's pool both read it.
"""

from __future__ import annotations

from dataclasses import dataclass

from ruvllm.config import ModelConfig


@dataclass(frozen=True, slots=True)
class KVGroup:
    layers: tuple[int, ...]
    window: int | None = None  # keys a query sees, itself included; None: the whole context


@dataclass(frozen=True, slots=True)
class KVLayout:
    groups: tuple[KVGroup, ...]

    @property
    def group_size(self) -> int:
        """Layers whose K/V one block holds: the pool's slot tensors, one per position in a group."""
        return max(len(g.layers) for g in self.groups)

    @property
    def windows(self) -> tuple[int | None, ...]:
        return tuple(g.window for g in self.groups)

    @property
    def is_hybrid(self) -> bool:
        return len(self.groups) > 1 or self.groups[0].window is not None

    def place(self, layer: int) -> tuple[int, int]:
        """(group, slot) of a layer: it reads its group's block tables and writes its slot's tensor."""
        for g, group in enumerate(self.groups):
            if layer in group.layers:
                return g, group.layers.index(layer)
        raise ValueError(f"layer {layer} is in no KV group")

    def blocks_needed(self, num_tokens: int, chunk: int, block_size: int) -> int:
        """Blocks one sequence of `num_tokens` holds at most while its last `chunk` tokens are
        computed: the whole context in full groups, the window and the chunk in sliding ones."""
        full = -(-num_tokens // block_size)
        total = 0
        for g in self.groups:
            if g.window is None:
                total += full
            else:
                total += min(full, -(-(g.window - 1 + chunk) // block_size) + 1)
        return total

    def max_tokens(self, num_blocks: int, chunk: int, block_size: int, limit: int) -> int:
        """The longest sequence (at most `limit`) whose blocks fit in `num_blocks`."""
        lo, hi = 0, limit
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.blocks_needed(mid, min(chunk, mid), block_size) <= num_blocks:
                lo = mid
            else:
                hi = mid - 1
        return lo


def kv_layout(cfg: ModelConfig) -> KVLayout:
    """Full-attention layers first (group 0 covers the whole context, so whatever reads one table
    for all positions, a draft model or a test, reads that one), then the sliding ones."""
    sliding = [i for i in cfg.sliding_layers if i < cfg.num_layers] if cfg.sliding_window else []
    full = [i for i in range(cfg.num_layers) if i not in sliding]
    if not sliding:
        return KVLayout((KVGroup(tuple(full)),))
    size = min(len(full), len(sliding)) if full else len(sliding)
    groups = [KVGroup(tuple(full[i:i + size])) for i in range(0, len(full), size)]
    groups += [KVGroup(tuple(sliding[i:i + size]), cfg.sliding_window) for i in range(0, len(sliding), size)]
    return KVLayout(tuple(groups))
