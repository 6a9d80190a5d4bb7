"""The two-tier KV pool: migration in the block pool and the KV manager, how the tiers are sized
from one memory budget, and the settings' errors."""

from __future__ import annotations

import pytest
import torch

from ruvllm.config import CacheConfig, SchedulerConfig
from ruvllm.core.block_pool import BlockPool
from ruvllm.core.kv_cache_manager import KVCacheManager
from ruvllm.engine.llm import build_engine_config
from ruvllm.loader import load_model_config, resolve_model
from ruvllm.request import Request
from ruvllm.sampling_params import SamplingParams
from ruvllm.worker.kv_sizing import hot_blocks_wanted, kv_capacity_ratio, kv_tier_blocks, num_kv_blocks

BS = 16


def test_migrate_swaps_ids_and_keeps_the_hash() -> None:
    pool = BlockPool(4, 3)  # hot 0..3, cold 4..6
    assert (pool.num_free_hot, pool.num_free_cold, pool.num_free, pool.num_blocks) == (4, 3, 7, 7)
    a, b = pool.allocate(2)
    pool.register(a, 11, (1, 2))
    assert pool.migrate(a) == (0, 4)
    assert a.block_id == 4 and pool.is_cold(a) and pool.blocks[4] is a
    assert pool.lookup(11, (1, 2)) is a  # the hash moved with the block
    assert pool.migrate(a) is None  # already cold
    # the vacated hot id is free and keeps the exact K/V, findable, until it is handed out (last)
    copy = pool.blocks[0]
    assert pool.num_free_hot == 3 and copy.ref_count == 0 and pool.exact_copy(a) is copy
    assert pool.exact_copy(b) is b  # a hot block is its own exact copy
    assert [x.block_id for x in pool.allocate(2)] == [2, 3] and pool.exact_copy(a) is copy
    assert [x.block_id for x in pool.allocate(1)] == [0] and pool.exact_copy(a) is None and copy.block_hash is None
    # an uncached block leaves nothing worth keeping: its hot id is handed out first
    pool.release([pool.blocks[2], pool.blocks[3]])
    assert pool.migrate(b) == (1, 5) and [x.block_id for x in pool.allocate(1)] == [1]
    pool.release([pool.blocks[0], pool.blocks[1]])
    # releasing returns each block to its own tier's free list
    pool.release([a, b])
    assert (pool.num_free_hot, pool.num_free_cold) == (4, 3)
    # a freed cold block stays cached and revives from the cold list
    assert pool.lookup(11, (1, 2)) is a
    pool.touch([a])
    assert a.ref_count == 1 and pool.num_free_cold == 2


def test_migrate_takes_the_least_recently_freed_cold_block_and_evicts_it() -> None:
    pool = BlockPool(4, 2)
    blocks = pool.allocate(4)
    for i, blk in enumerate(blocks):
        pool.register(blk, 100 + i, (i,))
    assert [pool.migrate(b_)[1] for b_ in blocks[:2]] == [4, 5]
    assert pool.migrate(blocks[2]) is None  # the cold tier is full
    pool.release([blocks[1]])
    pool.release([blocks[0]])  # cold 5 freed first, then 4
    assert pool.migrate(blocks[2]) == (2, 5)  # LRU: 5, whose cached contents go
    assert pool.lookup(101, (1,)) is None and pool.lookup(100, (0,)) is blocks[0]
    with pytest.raises(RuntimeError):
        pool.allocate(5)


def _req(n: int, rid: str = "r") -> Request:
    return Request(rid, list(range(100, 100 + n)), SamplingParams())


@pytest.mark.parametrize("hot_tokens", [0, 1, 16, 20, 64])
def test_blocks_move_once_every_later_query_reads_them_as_old(hot_tokens: int) -> None:
    kv = KVCacheManager(64, BS, True, num_cold_blocks=64, hot_tokens=hot_tokens)
    r = _req(300)
    assert kv.allocate_slots(r, 1)
    most_hot = 0
    for ctx in range(1, 300):  # one token a step
        r.num_computed_tokens = ctx
        kv.cache_full_blocks(r)
        kv.migrate_cold([r])
        cold = [kv.pool.is_cold(b) for b in kv._blocks["r"]]
        expect = [(i + 1) * BS <= min(ctx, ctx // BS * BS + 1 - hot_tokens) for i in range(len(cold))]
        assert cold == expect, ctx
        assert kv.allocate_slots(r, 1)  # the next token
        most_hot = max(most_hot, sum(not c for c in cold) + (len(kv._blocks["r"]) - len(cold)))
    want, _ = hot_blocks_wanted(CacheConfig(kv_hot_tokens=hot_tokens),
                                SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=1), 10**6)
    assert most_hot == want - 2  # the sizing's per-sequence term (want - one 1-token step's 2 blocks) is exact
    kv.free(r)
    assert (kv.pool.num_free_hot, kv.pool.num_free_cold) == (64, 64)


def test_migration_waits_for_cold_space_and_resumes() -> None:
    kv = KVCacheManager(16, BS, True, num_cold_blocks=2, hot_tokens=16)
    r = _req(160)
    assert kv.allocate_slots(r, 160)
    r.num_computed_tokens = 160
    kv.cache_full_blocks(r)
    moves = kv.migrate_cold([r])
    assert [m[0] for m in moves] == [0, 1] and [m[1] for m in moves] == [16, 17]  # two fit
    assert kv.migrate_cold([r]) == []
    other = _req(40, "o")
    assert kv.allocate_slots(other, 40)
    other.num_computed_tokens = 40
    kv.free(other)
    kv.free(r)  # frees cold 16, 17 and the hot blocks
    assert (kv.pool.num_free_hot, kv.pool.num_free_cold) == (16, 2)


def test_a_shared_block_moves_once_it_is_old_for_every_holder() -> None:
    kv = KVCacheManager(16, BS, True, num_cold_blocks=8, hot_tokens=16)
    a, b = _req(64, "a"), _req(64, "b")
    assert kv.allocate_slots(a, 64)
    a.num_computed_tokens = 64
    kv.cache_full_blocks(a)
    hits, n = kv.get_computed_blocks(b)
    assert n == 48 and kv.allocate_slots(b, 16, hits)
    b.num_computed_tokens = 48
    # a reads blocks 0..2 as old; b (at 48) still reads block 2 exactly, so only 0 and 1 move
    assert len(kv.migrate_cold([a])) == 2
    assert kv.block_table("b")[:3] == kv.block_table("a")[:3]
    assert [kv.pool.is_cold(blk) for blk in kv._blocks["a"]] == [True, True, False, False]
    b.num_computed_tokens = 64  # b moves on: block 2 is old for both
    assert len(kv.migrate_cold([a])) == 1 and kv.pool.is_cold(kv._blocks["a"][2])
    for r in (a, b):
        kv.free(r)
    assert (kv.pool.num_free_hot, kv.pool.num_free_cold) == (16, 8)


def test_a_prefix_hit_reads_its_hot_window_exactly() -> None:
    """Cold blocks inside the hit's hot window are swapped for the exact hot copies their move left
    behind; once the hot tier reuses those, the hit ends where every block it reads exactly is hot."""
    kv = KVCacheManager(8, BS, True, num_cold_blocks=8, hot_tokens=16)
    a = _req(80, "a")
    assert kv.allocate_slots(a, 80)
    a.num_computed_tokens = 80
    kv.cache_full_blocks(a)
    assert len(kv.migrate_cold([a])) == 4  # blocks 0..3 cold; a's 5 blocks: hot ids 0..4 were used
    kv.free(a)
    c = _req(80, "c")  # the same tokens: a hit of 4 blocks (the last token is always computed)
    hits, n = kv.get_computed_blocks(c)
    assert n == 64 and [kv.pool.is_cold(h) for h in hits] == [True, True, True, False]
    assert hits[3] is kv.pool.exact_copy(kv.pool.lookup(hits[3].block_hash, hits[3].token_ids))
    # the hot tier hands out every free hot block: the copies are gone, and so is the exact hit
    filler = _req(8 * BS, "f")
    assert kv.allocate_slots(filler, 8 * BS)
    hits, n = kv.get_computed_blocks(c)
    assert n == 0
    kv.free(filler)
    assert (kv.pool.num_free_hot, kv.pool.num_free_cold) == (8, 8)


# ------------------------------------------------------------------------------- sizing

@pytest.fixture(scope="module")
def model_cfg():
    return load_model_config(resolve_model(None))  # the default model's shape (no weights loaded)


@pytest.mark.parametrize(("kv", "least"), [("int8", 1.8), ("int4", 3.0)])
def test_capacity_under_one_budget(model_cfg, kv: str, least: float) -> None:
    """The default settings (1 GiB, 64 sequences, 512-token steps, 64 hot tokens) hold >= 1.8x
    (int8) and >= 3x (int4) the tokens of the 16-bit cache, and more as the budget grows."""
    sched = SchedulerConfig().resolved("cpu")  # the default token budget is the device's (512 on CPU)
    for gib in (1, 4):
        budget = gib << 30
        dense = num_kv_blocks(model_cfg, CacheConfig(kv_cache_memory_bytes=budget), torch.bfloat16)
        cache = CacheConfig(kv_cache_memory_bytes=budget, kv_cache_dtype=kv)
        hot, cold = kv_tier_blocks(model_cfg, cache, sched, torch.bfloat16, 8192)
        assert (hot + cold) / dense >= least, (gib, hot, cold, dense)
        ratio = kv_capacity_ratio(model_cfg, BS, torch.bfloat16, kv, hot, cold)
        assert abs(ratio - (hot + cold) / dense) < 0.01
        want, _ = hot_blocks_wanted(cache, sched, 8192)
        assert hot == want  # every running sequence keeps its hot window
    # num_blocks is a budget in 16-bit blocks
    hot, cold = kv_tier_blocks(model_cfg, CacheConfig(num_blocks=2000, kv_cache_dtype="int4"), sched, torch.bfloat16, 8192)
    assert hot + cold > 3 * 2000


def test_hot_tier_is_capped_at_half_but_holds_one_sequence(model_cfg) -> None:
    sched = SchedulerConfig(max_num_seqs=256, max_num_batched_tokens=512)
    cache = CacheConfig(num_blocks=400, kv_cache_dtype="int8", kv_hot_tokens=256)
    hot, cold = kv_tier_blocks(model_cfg, cache, sched, torch.bfloat16, 8192)
    assert hot == 200 and cold > 200
    tiny = CacheConfig(num_blocks=60, kv_cache_dtype="int8", kv_hot_tokens=256)
    _, need = hot_blocks_wanted(tiny, sched, 8192)
    hot, cold = kv_tier_blocks(model_cfg, tiny, sched, torch.bfloat16, 8192)
    assert hot == need and cold >= 1
    with pytest.raises(ValueError, match="cannot hold its hot tier"):
        kv_tier_blocks(model_cfg, CacheConfig(num_blocks=40, kv_cache_dtype="int8", kv_hot_tokens=256), sched,
                       torch.bfloat16, 8192)
    # without a quantized dtype: one tier, as before
    assert kv_tier_blocks(model_cfg, CacheConfig(num_blocks=40), sched, torch.bfloat16, 8192) == (40, 0)


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of auto, bf16, fp16, int8, int4, got 'int3'"):
        CacheConfig(kv_cache_dtype="int3")
    with pytest.raises(ValueError, match="kv_hot_tokens must be a whole number >= 0, got -1"):
        CacheConfig(kv_hot_tokens=-1)
    with pytest.raises(ValueError, match="kv_hot_tokens"):
        CacheConfig(kv_hot_tokens=1.5)  # type: ignore[arg-type]
    cfg = build_engine_config(kv_cache_dtype="int4", kv_hot_tokens=32)  # LLM(...) keywords reach CacheConfig
    assert (cfg.cache.kv_cache_dtype, cfg.cache.kv_hot_tokens) == ("int4", 32)
