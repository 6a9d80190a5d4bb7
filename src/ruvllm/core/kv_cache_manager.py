"""Which KV blocks each request holds: prefix-cache lookups, slot allocation, hashing, freeing."""

from __future__ import annotations

from dataclasses import dataclass

from ruvllm.core.block_pool import BlockPool, KVBlock
from ruvllm.request import Request


@dataclass(slots=True)
class PrefixCacheStats:
    queries: int = 0  # prompt tokens looked up
    hits: int = 0  # of those, tokens served from the cache


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool) -> None:
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks)
        self.stats = PrefixCacheStats()
        self._blocks: dict[str, list[KVBlock]] = {}
        self._hashes: dict[str, list[int]] = {}  # chained hashes of the request's full blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    @property
    def usage(self) -> float:
        return 1.0 - self.pool.num_free / self.pool.num_blocks

    def block_table(self, request_id: str) -> list[int]:
        return [b.block_id for b in self._blocks.get(request_id, ())]

    def num_blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def get_computed_blocks(self, req: Request) -> tuple[list[KVBlock], int]:
        """Longest run of cached full blocks at the start of the request's tokens.

        The last token is never taken from the cache: the step must compute it to get its logits."""
        if not self.enable_prefix_caching:
            return [], 0
        tokens = req.all_token_ids
        max_blocks = (len(tokens) - 1) // self.block_size
        hits: list[KVBlock] = []
        parent = None
        for i in range(max_blocks):
            chunk = tuple(tokens[i * self.block_size:(i + 1) * self.block_size])
            h = hash((parent, chunk))
            block = self.pool.lookup(h, chunk)
            if block is None:
                break
            hits.append(block)
            parent = h
        return hits, len(hits) * self.block_size

    def allocate_slots(self, req: Request, num_new_tokens: int,
                       computed_blocks: list[KVBlock] | None = None) -> bool:
        """Make room for `num_new_tokens` more tokens after the computed ones; False if the pool is short.

        `computed_blocks` (prefix-cache hits, on admission) are counted in the hit statistics only
        when the allocation succeeds, so a request that waits several steps is counted once."""
        computed_blocks = computed_blocks or []
        held = self._blocks.setdefault(req.request_id, [])
        num_computed = req.num_computed_tokens + len(computed_blocks) * self.block_size
        needed = self.num_blocks_needed(num_computed + num_new_tokens) - len(held) - len(computed_blocks)
        revived = sum(1 for b in computed_blocks if b.ref_count == 0)
        if needed > self.pool.num_free - revived:
            if not held:
                del self._blocks[req.request_id]
            return False
        if self.enable_prefix_caching and not held:  # admission
            self.stats.queries += req.num_tokens
            self.stats.hits += len(computed_blocks) * self.block_size
        self.pool.touch(computed_blocks)
        held.extend(computed_blocks)
        if needed > 0:
            held.extend(self.pool.allocate(needed))
        return True

    def cache_full_blocks(self, req: Request) -> None:
        """Register blocks that became full (all tokens computed) in the prefix cache."""
        if not self.enable_prefix_caching:
            return
        hashes = self._hashes.setdefault(req.request_id, [])
        num_full = req.num_computed_tokens // self.block_size
        if num_full <= len(hashes):
            return
        blocks = self._blocks[req.request_id]
        tokens = req.all_token_ids
        parent = hashes[-1] if hashes else None
        for i in range(len(hashes), num_full):
            chunk = tuple(tokens[i * self.block_size:(i + 1) * self.block_size])
            h = hash((parent, chunk))
            self.pool.register(blocks[i], h, chunk)
            hashes.append(h)
            parent = h

    def free(self, req: Request) -> None:
        """Return every block of the request; tail blocks first so they are evicted before shared heads."""
        blocks = self._blocks.pop(req.request_id, [])
        self._hashes.pop(req.request_id, None)
        self.pool.release(reversed(blocks))
