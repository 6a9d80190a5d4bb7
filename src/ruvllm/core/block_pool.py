"""The pool of KV blocks: ref counts, free lists in eviction order, and the prefix-cache index.

With a quantized KV cache (CacheConfig.kv_cache_dtype int8/int4) block ids come in two ranges: hot
blocks [0, num_hot) hold K/V in the compute dtype, cold blocks [num_hot, num_hot + num_cold) hold
int8/int4 codes. Each range has its own free list. New tokens are always written to hot blocks; a
full block whose tokens have left every later query's hot window moves to a cold block (`migrate`).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ruvllm.core.disk_index import DiskBlock


@dataclass(slots=True, eq=False)
class KVBlock:
    """A logical block. Its `block_id` (where its K/V live) changes when it migrates to the cold
    tier, so every request holding it, and the prefix-cache index, follow it without being told."""

    block_id: int
    ref_count: int = 0
    block_hash: int | None = None  # set once the block is full and registered in the prefix cache
    token_ids: tuple[int, ...] | None = None  # kept to verify a hash hit token by token
    disk: DiskBlock | None = None  # its name in the disk tier (core/disk_index.py), when it may go there


class BlockPool:
    """Blocks with ref_count 0 sit in their tier's free list (least recently freed first); cached ones
    keep their hash until they are handed out again, so a later request can revive them."""

    def __init__(self, num_blocks: int, num_cold: int = 0) -> None:
        self.num_hot = num_blocks
        self.num_cold = num_cold
        self.num_blocks = num_blocks + num_cold
        self.blocks = [KVBlock(i) for i in range(self.num_blocks)]  # indexed by block id
        self._free: OrderedDict[int, KVBlock] = OrderedDict((b.block_id, b) for b in self.blocks[:num_blocks])
        self._free_cold: OrderedDict[int, KVBlock] = OrderedDict((b.block_id, b) for b in self.blocks[num_blocks:])
        self._cached: dict[int, KVBlock] = {}
        # hash -> the hot block a moved block left behind, still holding its exact K/V (free until
        # a prefix hit revives it or the hot tier needs the id): see migrate.
        self._exact: dict[int, KVBlock] = {}
        # With a disk tier: (block id, its disk name) of each cached block handed out again since
        # the caller last took them; its K/V are still in the pool until this step's forward pass
        # overwrites them, so the worker copies them out first (KVCacheManager.take_spills).
        self.spills: list[tuple[int, DiskBlock]] | None = None

    @property
    def num_free(self) -> int:
        """Free blocks of both tiers."""
        return len(self._free) + len(self._free_cold)

    @property
    def num_free_hot(self) -> int:
        return len(self._free)

    @property
    def num_free_cold(self) -> int:
        return len(self._free_cold)

    def is_cold(self, block: KVBlock) -> bool:
        return block.block_id >= self.num_hot

    def _free_list(self, block: KVBlock) -> OrderedDict[int, KVBlock]:
        return self._free_cold if block.block_id >= self.num_hot else self._free

    def _take(self, free: OrderedDict[int, KVBlock]) -> KVBlock:
        _, block = free.popitem(last=False)
        if block.disk is not None:
            if self.spills is not None and self._cached.get(block.block_hash) is block:
                self.spills.append((block.block_id, block.disk))
            block.disk = None
        if block.block_hash is not None:  # evict its cached contents
            if self._cached.get(block.block_hash) is block:
                del self._cached[block.block_hash]
            if self._exact.get(block.block_hash) is block:
                del self._exact[block.block_hash]
            block.block_hash = None
            block.token_ids = None
        return block

    def allocate(self, n: int) -> list[KVBlock]:
        """`n` hot blocks (new tokens are always written in the compute dtype)."""
        if n > len(self._free):
            raise RuntimeError(f"asked for {n} blocks, {len(self._free)} free")
        out = []
        for _ in range(n):
            block = self._take(self._free)
            block.ref_count = 1
            out.append(block)
        return out

    def migrate(self, block: KVBlock) -> tuple[int, int] | None:
        """Move a hot block to the cold tier: it takes the id of the least recently freed cold block
        (whose cached contents, if any, are evicted), and that block takes the hot id, free. Returns
        (hot id, cold id) for the caller to quantize-copy the K/V, or None when no cold block is free.

        The hot id keeps the exact K/V until it is handed out again. If the block is in the prefix
        cache, that copy stays findable (exact_copy) and joins the hot free list last, so a later
        prefix hit can read the blocks inside its hot window exactly, as a miss would."""
        if block.block_id >= self.num_hot or not self._free_cold:
            return None
        spare = self._take(self._free_cold)
        hot_id, cold_id = block.block_id, spare.block_id
        block.block_id, spare.block_id = cold_id, hot_id
        self.blocks[cold_id], self.blocks[hot_id] = block, spare
        spare.ref_count = 0
        h = block.block_hash
        self._free[hot_id] = spare
        if h is not None and (self._cached.get(h) is block or self._exact.get(h) is block):
            spare.block_hash, spare.token_ids = h, block.token_ids
            self._exact[h] = spare
        else:
            self._free.move_to_end(hot_id, last=False)  # it holds nothing worth keeping: handed out first
        return hot_id, cold_id

    def exact_copy(self, block: KVBlock) -> KVBlock | None:
        """A hot block with `block`'s exact K/V: the block itself while hot, else the copy its move
        left behind if the hot tier has not reused it."""
        if block.block_id < self.num_hot:
            return block
        return self._exact.get(block.block_hash) if block.block_hash is not None else None

    def lookup(self, block_hash: int, token_ids: tuple[int, ...]) -> KVBlock | None:
        block = self._cached.get(block_hash)
        if block is None or block.token_ids != token_ids:
            return None
        return block

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Take a reference on cached blocks (reviving them from the free list if unreferenced)."""
        for block in blocks:
            if block.ref_count == 0:
                del self._free_list(block)[block.block_id]
            block.ref_count += 1

    def release(self, blocks: Iterable[KVBlock], first: bool = False) -> None:
        """Drop a holder of each block; a block nobody holds joins its free list, at the end
        (evicted last, its prefix-cache entry kept longest) or with `first` at the front."""
        for block in blocks:
            block.ref_count -= 1
            if block.ref_count == 0:
                free = self._free_list(block)
                free[block.block_id] = block
                if first:
                    free.move_to_end(block.block_id, last=False)

    def register(self, block: KVBlock, block_hash: int, token_ids: tuple[int, ...],
                 disk: DiskBlock | None = None) -> None:
        """Make a full block findable by its hash; a block with the same contents already cached wins.
        `disk`: its disk-tier name, for a spill when it is evicted."""
        if block.block_hash is not None or block_hash in self._cached:
            return
        block.block_hash = block_hash
        block.token_ids = token_ids
        block.disk = disk
        self._cached[block_hash] = block

    def cached_disk_blocks(self) -> list[tuple[int, DiskBlock]]:
        """(block id, disk name) of every cached block that may go to the disk tier."""
        return [(b.block_id, b.disk) for b in self._cached.values() if b.disk is not None]

    def reset_prefix_cache(self) -> None:
        for block in [*self._cached.values(), *self._exact.values()]:
            block.block_hash = None
            block.token_ids = None
            block.disk = None
        self._cached.clear()
        self._exact.clear()
