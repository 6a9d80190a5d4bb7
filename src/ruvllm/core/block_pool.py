"""The pool of KV blocks: ref counts, a free list in eviction order, and the prefix-cache index."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(slots=True, eq=False)
class KVBlock:
    block_id: int
    ref_count: int = 0
    block_hash: int | None = None  # set once the block is full and registered in the prefix cache
    token_ids: tuple[int, ...] | None = None  # kept to verify a hash hit token by token


class BlockPool:
    """Blocks with ref_count 0 sit in `_free` (least recently freed first); cached ones keep their hash
    until they are handed out again, so a later request can revive them."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, KVBlock] = OrderedDict((b.block_id, b) for b in self.blocks)
        self._cached: dict[int, KVBlock] = {}

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[KVBlock]:
        if n > len(self._free):
            raise RuntimeError(f"asked for {n} blocks, {len(self._free)} free")
        out = []
        for _ in range(n):
            _, block = self._free.popitem(last=False)
            if block.block_hash is not None:  # evict its cached contents
                if self._cached.get(block.block_hash) is block:
                    del self._cached[block.block_hash]
                block.block_hash = None
                block.token_ids = None
            block.ref_count = 1
            out.append(block)
        return out

    def lookup(self, block_hash: int, token_ids: tuple[int, ...]) -> KVBlock | None:
        block = self._cached.get(block_hash)
        if block is None or block.token_ids != token_ids:
            return None
        return block

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Take a reference on cached blocks (reviving them from the free list if unreferenced)."""
        for block in blocks:
            if block.ref_count == 0:
                del self._free[block.block_id]
            block.ref_count += 1

    def release(self, blocks: Iterable[KVBlock]) -> None:
        for block in blocks:
            block.ref_count -= 1
            if block.ref_count == 0:
                self._free[block.block_id] = block

    def register(self, block: KVBlock, block_hash: int, token_ids: tuple[int, ...]) -> None:
        """Make a full block findable by its hash; a block with the same contents already cached wins."""
        if block.block_hash is not None or block_hash in self._cached:
            return
        block.block_hash = block_hash
        block.token_ids = token_ids
        self._cached[block_hash] = block

    def reset_prefix_cache(self) -> None:
        for block in self._cached.values():
            block.block_hash = None
            block.token_ids = None
        self._cached.clear()
