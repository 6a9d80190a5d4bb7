"""KVCacheManager: prefix-cache lookups, slot allocation, hashing, freeing (block size 16)."""

from __future__ import annotations

from ruvllm.core.kv_cache_manager import KVCacheManager
from ruvllm.request import Request
from ruvllm.sampling_params import SamplingParams

BS = 16


def req(rid: str, tokens: list[int]) -> Request:
    return Request(rid, list(tokens), SamplingParams())


def prompt(n: int, start: int = 100) -> list[int]:
    return list(range(start, start + n))


def compute_all(kv: KVCacheManager, r: Request) -> None:
    """Admit `r` with its prefix hits, allocate the rest and mark everything computed (as a step would)."""
    hits, n_hit = kv.get_computed_blocks(r)
    assert kv.allocate_slots(r, r.num_tokens - n_hit, hits)
    r.num_computed_tokens = r.num_tokens
    kv.cache_full_blocks(r)


def test_allocate_slots_rounds_up_to_blocks() -> None:
    kv = KVCacheManager(8, BS, True)
    r = req("a", prompt(17))
    assert kv.allocate_slots(r, 17)
    assert kv.block_table("a") == [0, 1]
    assert kv.num_free_blocks == 6
    r.num_computed_tokens = 17
    assert kv.allocate_slots(r, 15)  # 32 tokens still fit in two blocks
    assert kv.num_free_blocks == 6
    assert kv.allocate_slots(r, 16)
    assert kv.block_table("a") == [0, 1, 2]
    assert kv.usage == 3 / 8


def test_get_computed_blocks_never_covers_the_last_token() -> None:
    kv = KVCacheManager(8, BS, True)
    compute_all(kv, req("a", prompt(48)))
    hits, n = kv.get_computed_blocks(req("b", prompt(32)))
    assert n == 16 and len(hits) == 1  # block 2 would cover token 31, the last one
    hits, n = kv.get_computed_blocks(req("c", prompt(33)))
    assert n == 32 and len(hits) == 2
    hits, n = kv.get_computed_blocks(req("d", prompt(16)))
    assert n == 0 and hits == []


def test_prefix_hit_stops_at_first_differing_block() -> None:
    kv = KVCacheManager(8, BS, True)
    compute_all(kv, req("a", prompt(48)))
    other = prompt(48)
    other[20] = 7  # second block differs
    hits, n = kv.get_computed_blocks(req("b", other))
    assert n == 16 and kv.block_table("a")[:1] == [h.block_id for h in hits]
    # hashes are chained: an identical second block after a different first one is no hit
    other = prompt(48)
    other[0] = 7
    assert kv.get_computed_blocks(req("c", other)) == ([], 0)


def test_hash_collision_rejected_by_token_check() -> None:
    kv = KVCacheManager(4, BS, True)
    toks = prompt(40)
    (fake,) = kv.pool.allocate(1)
    # a block whose hash is the one `toks`' first block would have, but holding other tokens
    kv.pool.register(fake, hash((None, tuple(toks[:BS]))), tuple(range(BS)))
    assert kv.get_computed_blocks(req("a", toks)) == ([], 0)


def test_allocate_slots_fails_without_side_effects() -> None:
    kv = KVCacheManager(4, BS, True)
    assert kv.allocate_slots(req("a", prompt(48)), 48)
    assert kv.num_free_blocks == 1
    b = req("b", prompt(20, start=500))
    assert not kv.allocate_slots(b, 20)
    assert kv.num_free_blocks == 1
    assert kv.block_table("b") == []
    assert "b" not in kv._blocks
    assert kv.allocate_slots(req("c", prompt(10, start=900)), 10)  # the one free block is still there


def test_allocate_slots_failure_leaves_hit_blocks_untouched() -> None:
    kv = KVCacheManager(3, BS, True)
    a = req("a", prompt(33))
    compute_all(kv, a)
    kv.free(a)
    assert kv.num_free_blocks == 3
    b = req("b", prompt(33 + 40))  # same first 33 tokens, needs 5 blocks in all
    hits, n = kv.get_computed_blocks(b)
    assert n == 32 and [h.ref_count for h in hits] == [0, 0]
    assert not kv.allocate_slots(b, b.num_tokens - n, hits)
    assert [h.ref_count for h in hits] == [0, 0]
    assert kv.num_free_blocks == 3
    assert "b" not in kv._blocks
    assert kv.get_computed_blocks(req("c", prompt(33)))[1] == 32


def test_revived_hit_blocks_count_against_free_blocks() -> None:
    kv = KVCacheManager(3, BS, True)
    a = req("a", prompt(33))
    compute_all(kv, a)
    a_table = kv.block_table("a")
    kv.free(a)
    b = req("b", prompt(40))  # 2 cached blocks (free, ref 0) + 1 new
    hits, n = kv.get_computed_blocks(b)
    assert kv.allocate_slots(b, b.num_tokens - n, hits)
    assert kv.block_table("b")[:2] == a_table[:2]
    assert kv.num_free_blocks == 0
    assert [blk.ref_count for blk in hits] == [1, 1]


def test_revived_hit_blocks_too_many_for_pool() -> None:
    """2 hits are free blocks; 2 more blocks needed; only 3 free in all -> must fail, not over-allocate."""
    kv = KVCacheManager(3, BS, True)
    a = req("a", prompt(33))
    compute_all(kv, a)
    kv.free(a)
    b = req("b", prompt(64))
    hits, n = kv.get_computed_blocks(b)
    assert n == 32
    assert not kv.allocate_slots(b, b.num_tokens - n, hits)
    assert kv.num_free_blocks == 3


def test_cache_full_blocks_registers_only_full_computed_blocks() -> None:
    kv = KVCacheManager(4, BS, True)
    r = req("a", prompt(40))
    assert kv.allocate_slots(r, 40)
    blocks = [kv.pool.blocks[i] for i in kv.block_table("a")]
    r.num_computed_tokens = 20
    kv.cache_full_blocks(r)
    assert [b.block_hash is not None for b in blocks] == [True, False, False]
    r.num_computed_tokens = 40
    kv.cache_full_blocks(r)
    assert [b.block_hash is not None for b in blocks] == [True, True, False]
    assert blocks[1].token_ids == tuple(prompt(40)[16:32])


def test_cache_full_blocks_covers_output_tokens() -> None:
    kv = KVCacheManager(4, BS, True)
    r = req("a", prompt(10))
    assert kv.allocate_slots(r, 10)
    r.num_computed_tokens = 10
    r.output_token_ids.extend(range(7, 14))  # 17 tokens now
    assert kv.allocate_slots(r, 7)
    r.num_computed_tokens = 17
    kv.cache_full_blocks(r)
    hits, n = kv.get_computed_blocks(req("b", prompt(10) + list(range(7, 14))))
    assert n == 16 and hits[0].block_id == kv.block_table("a")[0]


def test_prefix_caching_disabled() -> None:
    kv = KVCacheManager(4, BS, False)
    a = req("a", prompt(40))
    compute_all(kv, a)
    assert all(kv.pool.blocks[i].block_hash is None for i in kv.block_table("a"))
    assert kv.get_computed_blocks(req("b", prompt(40))) == ([], 0)
    assert (kv.stats.queries, kv.stats.hits) == (0, 0)


def test_free_returns_everything() -> None:
    kv = KVCacheManager(6, BS, True)
    r = req("a", prompt(50))
    compute_all(kv, r)
    assert kv.num_free_blocks == 2
    kv.free(r)
    assert kv.num_free_blocks == 6
    assert kv.block_table("a") == []
    assert all(b.ref_count == 0 for b in kv.pool.blocks)
    kv.free(r)  # idempotent
    assert kv.num_free_blocks == 6


def test_free_releases_tail_first_so_heads_are_evicted_last() -> None:
    kv = KVCacheManager(4, BS, True)
    a = req("a", prompt(49))  # 3 full blocks (registered) + 1 partial
    compute_all(kv, a)
    kv.free(a)
    x = req("x", prompt(1, start=900))
    assert kv.allocate_slots(x, 16)
    assert kv.block_table("x") == [3]  # the partial tail
    y = req("y", prompt(1, start=901))
    assert kv.allocate_slots(y, 16)
    assert kv.block_table("y") == [2]  # the third block goes next, the head blocks survive
    hits, n = kv.get_computed_blocks(req("b", prompt(49)))
    assert n == 32 and [h.block_id for h in hits] == [0, 1]


def test_two_requests_with_same_prompt_share_blocks() -> None:
    kv = KVCacheManager(8, BS, True)
    a = req("a", prompt(40))
    compute_all(kv, a)
    b = req("b", prompt(40))
    hits, n = kv.get_computed_blocks(b)
    assert n == 32
    assert kv.allocate_slots(b, 8, hits)
    ta, tb = kv.block_table("a"), kv.block_table("b")
    assert ta[:2] == tb[:2] and ta[2] != tb[2]
    assert [kv.pool.blocks[i].ref_count for i in ta] == [2, 2, 1]
    assert kv.num_free_blocks == 8 - 4
    kv.free(a)
    assert [kv.pool.blocks[i].ref_count for i in tb] == [1, 1, 1]
    assert kv.num_free_blocks == 8 - 3  # only a's private block came back


def test_stats_count_queries_and_hits_once_per_admission() -> None:
    kv = KVCacheManager(8, BS, True)
    compute_all(kv, req("a", prompt(40)))
    assert (kv.stats.queries, kv.stats.hits) == (40, 0)
    compute_all(kv, req("b", prompt(40)))
    assert (kv.stats.queries, kv.stats.hits) == (80, 32)
    # a request that cannot be admitted yet (pool short) is not counted, however often it is looked up
    big = req("c", prompt(200))
    for _ in range(3):
        hits, n = kv.get_computed_blocks(big)
        assert n == 32
        assert not kv.allocate_slots(big, big.num_tokens - n, hits)
    assert (kv.stats.queries, kv.stats.hits) == (80, 32)
    # growing an admitted request is not a new query
    a = req("d", prompt(5, start=7000))
    compute_all(kv, a)
    assert kv.allocate_slots(a, 1)
    assert (kv.stats.queries, kv.stats.hits) == (85, 32)
