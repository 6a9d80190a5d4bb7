"""Which KV blocks each request holds: prefix-cache lookups, slot allocation, hashing, freeing.

A request holds one block table per KV stream: per KV group (kv_groups.py: one for most models;
Gemma 3 has global groups and sliding-window groups), for its own tokens, and for an X-LoRA request
its scaling pass's as well. They grow together: every count here (blocks needed, prefix hits, what
is freed) is over all of a request's streams. A sliding group's stream gives back the blocks that
left the window of its next query; its table keeps a placeholder there (`_NULL`, read as block 0,
which no query reads)."""

from __future__ import annotations

from dataclasses import dataclass

from ruvllm.core.block_pool import BlockPool, KVBlock
from ruvllm.core.disk_index import DiskBlock, DiskTier, chain_key, chain_seed
from ruvllm.request import Request


@dataclass(slots=True)
class PrefixCacheStats:
    queries: int = 0  # prompt tokens looked up
    hits: int = 0  # of those, tokens served from the cache
    disk_queries: int = 0  # prompt tokens past the memory hits looked up in the disk tier
    disk_hits: int = 0  # of those, tokens loaded from disk


@dataclass(frozen=True, slots=True)
class _Stream:
    key: str  # the block table's key
    salt: object  # the prefix-cache hash chain's seed: a group's blocks hold only its layers' K/V
    window: int | None  # keys a query of this stream's layers sees (None: all)


class KVCacheManager:
    """`num_blocks` hot blocks, and with `num_cold_blocks` a quantized cold tier: a request's full
    blocks migrate there once every later query of the request reads them as old, that is once each
    of their tokens is at least `hot_tokens` positions older than the request's next token (see
    migrate_cold for the exact point). `windows`: per KV group, the window of its layers."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool,
                 num_cold_blocks: int = 0, hot_tokens: int = 0,
                 windows: tuple[int | None, ...] = (None,), disk: DiskTier | None = None) -> None:
        if num_cold_blocks and any(w is not None for w in windows):
            raise ValueError("a quantized KV tier cannot be combined with sliding-window layers")
        if disk is not None and (num_cold_blocks or len(windows) > 1 or not enable_prefix_caching):
            raise ValueError("the disk KV tier needs prefix caching, one KV group and no quantized cold tier")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.hot_tokens = hot_tokens
        self.windows = tuple(windows)
        self.pool = BlockPool(num_blocks, num_cold_blocks)
        self.stats = PrefixCacheStats()
        # A block a sliding stream gave back: it holds nothing, and no query reads it.
        self._null = KVBlock(0)
        # keyed by KV stream (a request id, its other groups' keys, its scaling pass's keys)
        self._blocks: dict[str, list[KVBlock]] = {}
        self._hashes: dict[str, list[int]] = {}  # chained hashes of the stream's full blocks
        self._cold_upto: dict[str, int] = {}  # leading blocks of the stream already cold
        self._requests: dict[str, Request] = {}  # the request of every stream holding blocks (for migrate_cold)
        # The disk tier (core/disk_index.py): the worker's store, and the disk keys of each eligible
        # request's full blocks (stream key -> chain), next to the in-memory hashes.
        self.disk = disk
        self._disk_chains: dict[str, list[bytes]] = {}
        if disk is not None:
            self.pool.spills = []

    @property
    def num_free_blocks(self) -> int:
        """Free blocks of both tiers."""
        return self.pool.num_free

    @property
    def usage(self) -> float:
        return 1.0 - self.pool.num_free / self.pool.num_blocks

    def _streams(self, req: Request) -> list[_Stream]:
        """Group 0 under the request's own keys (so one-group models hash and key as always)."""
        return [_Stream(key if g == 0 else f"{key}\x00kv{g}", salt if g == 0 else (salt, "kv group", g), window)
                for key, salt in req.kv_streams for g, window in enumerate(self.windows)]

    def block_table(self, key: str) -> list[int]:
        return [b.block_id for b in self._blocks.get(key, ())]

    def block_tables(self, key: str) -> list[list[int]]:
        """The tables of every KV group under a stream key (group 0 first)."""
        return [self.block_table(key if g == 0 else f"{key}\x00kv{g}") for g in range(len(self.windows))]

    def num_blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _first_needed(self, num_computed: int, window: int | None) -> int:
        """The first block a query at position num_computed (or later) reads."""
        return 0 if window is None else max(0, num_computed - window + 1) // self.block_size

    def _real(self, blocks: list[KVBlock]) -> list[KVBlock]:
        return [b for b in blocks if b is not self._null]

    def get_computed_blocks(self, req: Request) -> tuple[list[KVBlock], int]:
        """Longest run of cached full blocks at the start of the request's tokens, and the tokens
        they hold. With several KV streams: a run every stream has, each stream's blocks one after
        the other. A sliding stream needs only the blocks inside its window of the first computed
        query; the rest of its run is placeholders.

        The last token is never taken from the cache: the step must compute it to get its logits."""
        if not self.enable_prefix_caching:
            return [], 0
        streams = self._streams(req)
        chains = [self._cached_chain(req, s) for s in streams]
        k = min(len(c) for c in chains)
        while k and not all(s.window is None or None not in c[self._first_needed(k * self.block_size, s.window):k]
                            for s, c in zip(streams, chains)):
            k -= 1
        while True:
            heads = [self._exact_hits(c[:k]) if self.pool.num_cold else c[:k] for c in chains]
            shortest = min(len(h) for h in heads)
            if shortest == k:
                return [b for s, h in zip(streams, heads) for b in self._windowed(h, s.window, k)], k * self.block_size
            k = shortest

    def _windowed(self, head: list[KVBlock | None], window: int | None, k: int) -> list[KVBlock]:
        first = self._first_needed(k * self.block_size, window)
        return [self._null if i < first else b for i, b in enumerate(head)]  # type: ignore[misc]

    def _cached_chain(self, req: Request, stream: _Stream) -> list[KVBlock | None]:
        """The cached blocks of the request's leading full blocks, up to the first miss; for a
        sliding stream the whole chain, misses as None (only its window's blocks must be there)."""
        tokens = req.all_token_ids
        hits: list[KVBlock | None] = []
        parent = stream.salt
        for i in range((len(tokens) - 1) // self.block_size):
            chunk = tuple(tokens[i * self.block_size:(i + 1) * self.block_size])
            h = hash((parent, chunk))
            block = self.pool.lookup(h, chunk)
            if block is None and stream.window is None:
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
        streams = self._streams(req)
        for s in streams:
            if s.window is not None:
                self._slide(s, req.num_computed_tokens)
        per_stream = len(computed_blocks) // len(streams)
        hits = [computed_blocks[i * per_stream:(i + 1) * per_stream] for i in range(len(streams))]
        held = [self._blocks.get(s.key, []) for s in streams]
        total = self.num_blocks_needed(req.num_computed_tokens + per_stream * self.block_size + num_new_tokens)
        needed = [max(0, total - len(h) - len(c)) for h, c in zip(held, hits)]
        hit_blocks = self._real(computed_blocks)
        # New tokens take hot blocks; cold hits are revived from the cold free list.
        revived = sum(1 for b in hit_blocks if b.ref_count == 0 and not self.pool.is_cold(b))
        if sum(needed) > self.pool.num_free_hot - revived:
            return False
        if self.enable_prefix_caching and not any(held):  # admission
            self.stats.queries += req.num_tokens
            self.stats.hits += per_stream * self.block_size
        self.pool.touch(hit_blocks)
        for s, stream_hits, n in zip(streams, hits, needed):
            blocks = self._blocks.setdefault(s.key, [])
            self._requests[s.key] = req
            blocks.extend(stream_hits)
            if n > 0:
                blocks.extend(self.pool.allocate(n))
        return True

    def _slide(self, stream: _Stream, num_computed: int) -> None:
        """Give back the blocks of a sliding stream that left the window of its next query (at
        num_computed). A cached one keeps its hash in the free list, for a later prefix hit."""
        blocks = self._blocks.get(stream.key)
        if not blocks:
            return
        first = min(self._first_needed(num_computed, stream.window), len(blocks))
        gone = self._real(blocks[:first])
        if gone:
            blocks[:first] = [self._null] * first
            self.pool.release(gone)

    def cache_full_blocks(self, req: Request) -> None:
        """Register blocks that became full (all tokens computed) in the prefix cache."""
        if not self.enable_prefix_caching:
            return
        num_full = req.num_computed_tokens // self.block_size
        for s in self._streams(req):
            hashes = self._hashes.setdefault(s.key, [])
            if num_full <= len(hashes):
                continue
            blocks = self._blocks[s.key]
            tokens = req.all_token_ids
            parent = hashes[-1] if hashes else s.salt
            for i in range(len(hashes), num_full):
                chunk = tuple(tokens[i * self.block_size:(i + 1) * self.block_size])
                h = hash((parent, chunk))
                if blocks[i] is not self._null:
                    self.pool.register(blocks[i], h, chunk, self._disk_name(req, s.key, i, chunk))
                hashes.append(h)
                parent = h

    # --- the disk tier ---------------------------------------------------------------------------
    def _disk_seed(self, req: Request) -> bytes | None:
        """The disk chain's seed of the request's own stream, None when its blocks never go to
        disk: an adapter's (its load id names it in memory only; docs/decisions.md)."""
        if self.disk is None or req.adapter is not None:
            return None
        return chain_seed(self.disk.fingerprint, req.salt)

    def _disk_name(self, req: Request, key: str, i: int, chunk: tuple[int, ...]) -> DiskBlock | None:
        """The disk name of the stream's full block i (blocks are named in order, 0 first)."""
        if key != req.request_id:
            return None
        chain = self._disk_chains.setdefault(key, [])
        if len(chain) != i:  # (a stream is hashed once, in order; anything else is not named)
            return None
        seed = self._disk_seed(req)
        if seed is None:
            return None
        parent = chain[-1] if chain else seed
        chain.append(chain_key(parent, chunk))
        return DiskBlock(chain[-1], parent, chunk)

    def disk_lookup(self, req: Request, num_hit_blocks: int) -> list[DiskBlock]:
        """The request's full blocks after its `num_hit_blocks` memory hits that the disk tier
        holds, up to the first it lacks (never the block of the last token, as for memory hits)."""
        seed = self._disk_seed(req)
        if seed is None:
            return []
        tokens, bs = req.all_token_ids, self.block_size
        parent, out = seed, []
        for i in range((len(tokens) - 1) // bs):
            chunk = tuple(tokens[i * bs:(i + 1) * bs])
            key = chain_key(parent, chunk)
            if i >= num_hit_blocks:
                if key not in self.disk.index:  # type: ignore[union-attr]
                    break
                out.append(DiskBlock(key, parent, chunk))
            parent = key
        return out

    def count_disk_lookup(self, looked_up: int, loaded: int) -> None:
        self.stats.disk_queries += looked_up
        self.stats.disk_hits += loaded

    def take_spills(self) -> list[tuple[int, DiskBlock]]:
        """Cached blocks evicted since the last call whose K/V the worker must write to disk (before
        this step's forward pass reuses them); those already on disk are only marked used."""
        if self.pool.spills is None or not self.pool.spills:
            return []
        spills, self.pool.spills = self.pool.spills, []
        return [(b, d) for b, d in spills if not self.disk.index.touch(d.key)]  # type: ignore[union-attr]

    def spill_cached(self) -> list[tuple[int, DiskBlock]]:
        """Every cached block not yet on disk (the engine is closing: the prefix cache outlives it)."""
        if self.disk is None:
            return []
        return [(b, d) for b, d in self.pool.cached_disk_blocks() if not self.disk.index.touch(d.key)]

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
        for req, key in [(r, s.key) for r in reqs for s in self._streams(r)]:
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
        for s in self._streams(req):
            blocks = self._blocks.get(s.key)
            if blocks is not None and len(blocks) > keep:
                tail = blocks[keep:]
                del blocks[keep:]
                self.pool.release(self._real(tail), first=True)

    def free(self, req: Request) -> None:
        """Return every block of the request; tail blocks first so they are evicted before shared heads.

        An embedding request's blocks stay in the prefix cache (valid K/V: the same text embedded or
        quoted again hits them), but the ones it computed itself join the free list at the front, to
        be handed out first: a stream of one-off embeddings never pushes generation's cached
        prefixes (system prompts, conversations) out of the pool. Blocks it took from the prefix
        cache go back where any request's would."""
        hit_blocks = req.num_cached_tokens // self.block_size if req.pooling is not None else None
        for s in self._streams(req):
            blocks = self._blocks.pop(s.key, [])
            self._hashes.pop(s.key, None)
            self._disk_chains.pop(s.key, None)
            self._cold_upto.pop(s.key, None)
            self._requests.pop(s.key, None)
            if hit_blocks is None:
                self.pool.release(reversed(self._real(blocks)))
            else:  # own blocks moved to the front one by one: the tail ends first, evicted first
                self.pool.release(reversed(self._real(blocks[:hit_blocks])))
                self.pool.release(self._real(blocks[hit_blocks:]), first=True)
