"""Which KV blocks each request holds: prefix-cache lookups, slot allocation, hashing, freeing.

A request holds one block table per KV stream (Request.kv_streams): its own, and for an X-LoRA
request its scaling pass's as well. Both grow together: every count here (blocks needed, prefix
hits, what is freed) is over all of a request's streams."""

from __future__ import annotations

from dataclasses import dataclass

from ruvllm.core.block_pool import BlockPool, KVBlock
from ruvllm.request import Request


@dataclass(slots=True)
class PrefixCacheStats:
    queries: int = 0  # prompt tokens looked up
    hits: int = 0  # of those, tokens served from the cache


class KVCacheManager:
    """`num_blocks` hot blocks, and with `num_cold_blocks` a quantized cold tier: a request's full
    blocks migrate there once every later query of the request reads them as old, that is once each
    of their tokens is at least `hot_tokens` positions older than the request's next token (see
    migrate_cold for the exact point)."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool,
                 num_cold_blocks: int = 0, hot_tokens: int = 0) -> None:
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.hot_tokens = hot_tokens
        self.pool = BlockPool(num_blocks, num_cold_blocks)
        self.stats = PrefixCacheStats()
        # keyed by KV stream (a request id, or its scaling pass's key)
        self._blocks: dict[str, list[KVBlock]] = {}
        self._hashes: dict[str, list[int]] = {}  # chained hashes of the stream's full blocks
        self._cold_upto: dict[str, int] = {}  # leading blocks of the stream already cold
        self._requests: dict[str, Request] = {}  # the request of every stream holding blocks (for migrate_cold)

    @property
    def num_free_blocks(self) -> int:
        """Free blocks of both tiers."""
        return self.pool.num_free

    @property
    def usage(self) -> float:
        return 1.0 - self.pool.num_free / self.pool.num_blocks

    def block_table(self, request_id: str) -> list[int]:
        return [b.block_id for b in self._blocks.get(request_id, ())]

    def num_blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def get_computed_blocks(self, req: Request) -> tuple[list[KVBlock], int]:
        """Longest run of cached full blocks at the start of the request's tokens, and the tokens
        they hold. With several KV streams: a run every stream has, each stream's blocks one after
        the other.

        The last token is never taken from the cache: the step must compute it to get its logits."""
        if not self.enable_prefix_caching:
            return [], 0
        chains = [self._cached_chain(req, salt) for _, salt in req.kv_streams]
        k = min(len(c) for c in chains)
        while True:
            heads = [self._exact_hits(c[:k]) if self.pool.num_cold else c[:k] for c in chains]
            shortest = min(len(h) for h in heads)
            if shortest == k:
                return [b for h in heads for b in h], k * self.block_size
            k = shortest

    def _cached_chain(self, req: Request, salt: object) -> list[KVBlock]:
        tokens = req.all_token_ids
        hits: list[KVBlock] = []
        parent = salt
        for i in range((len(tokens) - 1) // self.block_size):
            chunk = tuple(tokens[i * self.block_size:(i + 1) * self.block_size])
            h = hash((parent, chunk))
            block = self.pool.lookup(h, chunk)
            if block is None:
                break
            hits.append(block)
            parent = h
        return hits

    def _num_old_blocks(self, num_tokens: int) -> int:
        """Leading blocks that every query at position >= num_tokens reads as old (dequantized):
        block i is old for a query at p when (i + 1) * block_size <= p + 1 - hot_tokens."""
        return max(0, num_tokens + 1 - self.hot_tokens) // self.block_size

    def _exact_hits(self, hits: list[KVBlock]) -> list[KVBlock]:
        """The longest head of `hits` that reads like a miss: the blocks inside the hot window of
        the request's first computed query must hold exact K/V, so a cold one there is swapped for
        the hot copy its move left behind (BlockPool.exact_copy), and without one the hit ends
        earlier. Reading it dequantized instead would make the output depend on what ran before."""
        for k in range(len(hits), 0, -1):
            head = hits[:k]
            for i in range(self._num_old_blocks(k * self.block_size), k):
                exact = self.pool.exact_copy(head[i])
                if exact is None:
                    break
                head[i] = exact
            else:
                return head
        return []

    def allocate_slots(self, req: Request, num_new_tokens: int,
                       computed_blocks: list[KVBlock] | None = None) -> bool:
        """Make room for `num_new_tokens` more tokens after the computed ones; False if the pool is short.

        `computed_blocks` (prefix-cache hits, on admission) are counted in the hit statistics only
        when the allocation succeeds, so a request that waits several steps is counted once."""
        computed_blocks = computed_blocks or []
        streams = [key for key, _ in req.kv_streams]
        per_stream = len(computed_blocks) // len(streams)
        hits = [computed_blocks[i * per_stream:(i + 1) * per_stream] for i in range(len(streams))]
        held = [self._blocks.get(key, []) for key in streams]
        total = self.num_blocks_needed(req.num_computed_tokens + per_stream * self.block_size + num_new_tokens)
        needed = [max(0, total - len(h) - len(c)) for h, c in zip(held, hits)]
        # New tokens take hot blocks; cold hits are revived from the cold free list.
        revived = sum(1 for b in computed_blocks if b.ref_count == 0 and not self.pool.is_cold(b))
        if sum(needed) > self.pool.num_free_hot - revived:
            return False
        if self.enable_prefix_caching and not any(held):  # admission
            self.stats.queries += req.num_tokens
            self.stats.hits += per_stream * self.block_size
        self.pool.touch(computed_blocks)
        for key, stream_hits, n in zip(streams, hits, needed):
            blocks = self._blocks.setdefault(key, [])
            self._requests[key] = req
            blocks.extend(stream_hits)
            if n > 0:
                blocks.extend(self.pool.allocate(n))
        return True

    def cache_full_blocks(self, req: Request) -> None:
        """Register blocks that became full (all tokens computed) in the prefix cache."""
        if not self.enable_prefix_caching:
            return
        num_full = req.num_computed_tokens // self.block_size
        for key, salt in req.kv_streams:
            hashes = self._hashes.setdefault(key, [])
            if num_full <= len(hashes):
                continue
            blocks = self._blocks[key]
            tokens = req.all_token_ids
            parent = hashes[-1] if hashes else salt
            for i in range(len(hashes), num_full):
                chunk = tuple(tokens[i * self.block_size:(i + 1) * self.block_size])
                h = hash((parent, chunk))
                self.pool.register(blocks[i], h, chunk)
                hashes.append(h)
                parent = h

    def _num_movable(self, req: Request, key: str) -> int:
        """Leading blocks of the request that none of its later queries reads exactly: old for a
        query at the start of the block holding its next token (num_computed_tokens rounded down
        to a block). Moving them then costs no more hot blocks than moving each as soon as the next
        query reads it as old, and a prefix hit that ends at the request's last full block finds
        every block young for the hit's first query still hot. Only fully computed blocks move."""
        ctx = req.num_computed_tokens
        start = ctx // self.block_size * self.block_size
        return min(len(self._blocks[key]), ctx // self.block_size, self._num_old_blocks(start))

    def migrate_cold(self, reqs: list[Request]) -> list[tuple[int, int]]:
        """Move blocks that no later query of any holder reads exactly to the cold tier.

        Attention reads an old block dequantized whether or not it has moved (a hot one
        fake-quantized with the same quantizer), so moving is a matter of memory only; but a block
        shared through the prefix cache moves only once it is old for every request holding it,
        since a holder further behind still reads it exactly. Stops early when the cold tier is full
        (the rest wait for a later step). Returns (hot id, cold id) pairs whose K/V the model runner
        must quantize-copy before the next forward pass."""
        if not self.pool.num_cold:
            return []
        young: set[int] | None = None  # ids of shared blocks some holder still reads exactly
        moves = []
        for req, key in [(r, key) for r in reqs for key, _ in r.kv_streams]:
            blocks = self._blocks.get(key)
            if not blocks:
                continue
            movable = self._num_movable(req, key)
            upto = None  # the first block left behind, where the next call starts
            for i in range(self._cold_upto.get(key, 0), movable):
                block = blocks[i]
                if self.pool.is_cold(block):
                    continue
                if block.ref_count > 1:
                    if young is None:
                        young = self._young_shared_blocks()
                    if id(block) in young:
                        upto = i if upto is None else upto
                        continue
                move = self.pool.migrate(block)
                if move is None:  # the cold tier is full
                    upto = i if upto is None else upto
                    break
                moves.append(move)
            self._cold_upto[key] = movable if upto is None else upto
        return moves

    def _young_shared_blocks(self) -> set[int]:
        """Shared blocks that some holder will still read exactly (past its movable head)."""
        young = set()
        for key, req in self._requests.items():
            for block in self._blocks[key][self._num_movable(req, key):]:
                if block.ref_count > 1:
                    young.add(id(block))
        return young

    def trim(self, req: Request) -> None:
        """Give back the tail blocks past the request's tokens (speculation: blocks allocated for
        proposals that were rejected). They never held a computed token, so none is in the prefix
        cache; the next step allocates again what it needs."""
        keep = self.num_blocks_needed(req.num_tokens)
        for key, _ in req.kv_streams:
            blocks = self._blocks.get(key)
            if blocks is not None and len(blocks) > keep:
                tail = blocks[keep:]
                del blocks[keep:]
                self.pool.release(tail, first=True)

    def free(self, req: Request) -> None:
        """Return every block of the request; tail blocks first so they are evicted before shared heads."""
        for key, _ in req.kv_streams:
            blocks = self._blocks.pop(key, [])
            self._hashes.pop(key, None)
            self._cold_upto.pop(key, None)
            self._requests.pop(key, None)
            self.pool.release(reversed(blocks))
