"""KV groups (kv_groups.py) and the KV cache manager's sliding-window streams: which layers share a
block table, blocks given back once they leave the window, prefix hits that need only the window's
blocks, speculation's trim, and every block back in the pool at the end (block size 4)."""

from __future__ import annotations

import dataclasses

from ruvllm.core.kv_cache_manager import KVCacheManager
from ruvllm.kv_groups import KVGroup, kv_layout
from ruvllm.request import Request
from ruvllm.sampling_params import SamplingParams
from tests.engine_fixtures import TINY_GQA

BS = 4
WINDOW = 6  # a query at p sees p-5 .. p: with blocks of 4, at most 3 blocks


def _gemma_like(num_layers: int = 18, every: int = 6):
    return dataclasses.replace(TINY_GQA, architecture="gemma3", num_layers=num_layers, sliding_window=512,
                               sliding_layers=tuple(i for i in range(num_layers) if (i + 1) % every))


def test_layout_of_gemma3_270m() -> None:
    """15 sliding layers and 3 global ones: groups of 3 layers, the global group first."""
    layout = kv_layout(_gemma_like())
    assert layout.groups[0] == KVGroup((5, 11, 17), None)
    assert [g.layers for g in layout.groups[1:]] == [(0, 1, 2), (3, 4, 6), (7, 8, 9), (10, 12, 13), (14, 15, 16)]
    assert layout.windows == (None, 512, 512, 512, 512, 512)
    assert layout.group_size == 3
    assert layout.place(11) == (0, 1) and layout.place(6) == (2, 2)
    # the whole context in the global group, the window and a chunk in each sliding one
    assert layout.blocks_needed(4096, 256, 16) == 256 + 5 * (-(-(511 + 256) // 16) + 1)
    assert layout.max_tokens(10_000, 256, 16, 32768) == 32768
    assert kv_layout(TINY_GQA).groups == (KVGroup((0, 1)),)  # one group: every layer, no window


def test_uneven_layer_counts_pad_the_last_group() -> None:
    layout = kv_layout(_gemma_like(num_layers=8, every=3))  # global 2, 5; sliding 0, 1, 3, 4, 6, 7
    assert [g.layers for g in layout.groups] == [(2, 5), (0, 1), (3, 4), (6, 7)]
    layout = kv_layout(_gemma_like(num_layers=7, every=3))  # global 2, 5; sliding 0, 1, 3, 4, 6
    assert [g.layers for g in layout.groups] == [(2, 5), (0, 1), (3, 4), (6,)]


def _manager(num_blocks: int = 64, prefix: bool = True) -> KVCacheManager:
    return KVCacheManager(num_blocks, BS, prefix, windows=(None, WINDOW))


def _run(kv: KVCacheManager, r: Request, chunk: int, upto: int | None = None) -> None:
    """Compute the request's tokens chunk by chunk (as the scheduler would), from its prefix hits."""
    hits, n_hit = kv.get_computed_blocks(r)
    first = min(chunk, r.num_tokens - n_hit)
    assert kv.allocate_slots(r, first, hits)
    r.num_computed_tokens = n_hit + first
    kv.cache_full_blocks(r)
    while r.num_computed_tokens < (upto or r.num_tokens):
        n = min(chunk, r.num_tokens - r.num_computed_tokens)
        assert kv.allocate_slots(r, n)
        r.num_computed_tokens += n
        kv.cache_full_blocks(r)


def _live(kv: KVCacheManager, key: str) -> list[bool]:
    """Per entry of a sliding stream's table: whether it holds a block (False: a placeholder for one given back)."""
    return [b is not kv._null for b in kv._blocks[key + "\x00kv1"]]


def test_sliding_stream_gives_back_blocks_outside_the_window() -> None:
    kv = _manager()
    r = Request("a", list(range(100, 140)), SamplingParams())
    _run(kv, r, chunk=4)
    full, sliding = kv.block_tables("a")
    assert len(full) == len(sliding) == 10 and len(set(full)) == 10
    # blocks up to 6 (positions ..27) went back when the last chunk was allocated (its first query,
    # at 36, sees 31..36: blocks 7 on)
    assert _live(kv, "a") == [False] * 7 + [True] * 3
    assert kv.num_free_blocks == 64 - 10 - 3
    # one more token: its allocation gives back what left the window of the query at 40
    r.output_token_ids.append(7)
    assert kv.allocate_slots(r, 1)
    assert _live(kv, "a") == [False] * 8 + [True] * 3  # the query at 40 sees 35..40: blocks 8 on
    kv.free(r)
    assert kv.num_free_blocks == 64


def test_prefix_hit_needs_only_the_windows_blocks() -> None:
    """A second request with the same 40-token prompt hits all 9 full blocks (the last token is
    always computed): the global stream's 9 and the sliding stream's blocks inside the window of the
    first computed query (position 36 sees 31..36: blocks 7 and 8), even though the sliding stream's
    earlier blocks were given back (cached blocks stay findable in the free list until reused)."""
    kv = _manager()
    a = Request("a", list(range(100, 140)), SamplingParams())
    _run(kv, a, chunk=4)
    b = Request("b", list(range(100, 140)), SamplingParams())
    hits, n_hit = kv.get_computed_blocks(b)
    assert n_hit == 36
    assert len(hits) == 2 * 9
    assert all(h is kv._null for h in hits[9:16]) and all(h is not kv._null for h in hits[16:])
    assert kv.allocate_slots(b, 4, hits)
    assert kv.block_tables("b")[0][:9] == kv.block_tables("a")[0][:9]  # shared, not copied
    kv.free(a)
    kv.free(b)
    assert kv.num_free_blocks == 64


def test_prefix_hit_stops_where_a_window_block_was_evicted() -> None:
    """When the pool has reused a sliding block that a hit's window needs, the hit is shorter: it
    ends where every stream still has what its first query reads."""
    kv = _manager()
    a = Request("a", list(range(100, 140)), SamplingParams())
    _run(kv, a, chunk=4)
    for t in range(8):  # a decodes on to 48: its sliding blocks 7 and 8 go back (cached)
        a.output_token_ids.append(t)
        assert kv.allocate_slots(a, 1)
        a.num_computed_tokens += 1
        kv.cache_full_blocks(a)
    assert _live(kv, "a") == [False] * 10 + [True] * 2
    # the pool hands out sliding block 8 to someone else: its cached K/V are gone
    block8 = kv.pool.lookup(*_hash_of_block(kv, a, 8))
    assert block8 is not None and block8.ref_count == 0
    kv.pool._free.move_to_end(block8.block_id, last=False)
    taken = kv.pool.allocate(1)
    assert taken == [block8] and kv.pool.lookup(*_hash_of_block(kv, a, 8)) is None
    b = Request("b", list(range(100, 140)), SamplingParams())
    hits, n_hit = kv.get_computed_blocks(b)
    # 9 blocks would need sliding 7 and 8 (a query at 36 sees 31..36); 8 blocks need 6 and 7 (27..32)
    assert n_hit == 32 and len(hits) == 2 * 8
    assert kv.allocate_slots(b, b.num_tokens - n_hit, hits)
    kv.pool.release(taken)
    kv.free(a)
    kv.free(b)
    assert kv.num_free_blocks == 64


def _hash_of_block(kv: KVCacheManager, r: Request, i: int) -> tuple[int, tuple[int, ...]]:
    """The prefix-cache key of block i of r's sliding stream."""
    return kv._hashes[r.request_id + "\x00kv1"][i], tuple(r.all_token_ids[i * BS:(i + 1) * BS])


def test_trim_after_rejected_proposals_keeps_the_window() -> None:
    kv = _manager()
    r = Request("a", list(range(100, 130)), SamplingParams())
    _run(kv, r, chunk=8)
    r.output_token_ids.append(1)
    assert kv.allocate_slots(r, 1 + 8)  # a decode with room for 8 proposals
    assert len(kv.block_tables("a")[1]) == 10
    r.num_computed_tokens += 1  # none accepted
    kv.trim(r)
    full, sliding = kv.block_tables("a")
    assert len(full) == len(sliding) == 8
    assert sum(_live(kv, "a")) <= 3
    kv.free(r)
    assert kv.num_free_blocks == 64


def test_quantized_tier_is_refused_with_windows() -> None:
    import pytest

    with pytest.raises(ValueError, match="sliding-window"):
        KVCacheManager(8, BS, True, num_cold_blocks=8, hot_tokens=16, windows=(None, 512))
