"""BlockPool: ref counts, the LRU free list, and the prefix-cache index."""

from __future__ import annotations

import pytest

from ruvllm.core.block_pool import BlockPool


def ids(blocks) -> list[int]:
    return [b.block_id for b in blocks]


def test_allocate_hands_out_blocks_with_one_reference() -> None:
    pool = BlockPool(4)
    blocks = pool.allocate(3)
    assert ids(blocks) == [0, 1, 2]
    assert [b.ref_count for b in blocks] == [1, 1, 1]
    assert pool.num_free == 1


def test_allocate_raises_when_short_and_takes_nothing() -> None:
    pool = BlockPool(4)
    pool.allocate(2)
    with pytest.raises(RuntimeError):
        pool.allocate(3)
    assert pool.num_free == 2
    assert ids(pool.allocate(2)) == [2, 3]


def test_ref_counting_frees_only_at_zero() -> None:
    pool = BlockPool(2)
    (b,) = pool.allocate(1)
    pool.touch([b])  # a second holder
    assert b.ref_count == 2
    pool.release([b])
    assert b.ref_count == 1 and pool.num_free == 1
    pool.release([b])
    assert b.ref_count == 0 and pool.num_free == 2


def test_release_order_is_eviction_order() -> None:
    pool = BlockPool(4)
    a, b, c, d = pool.allocate(4)
    pool.release([c])
    pool.release([a])
    pool.release([d, b])
    # least recently freed first
    assert [ids(pool.allocate(1)) for _ in range(4)] == [[2], [0], [3], [1]]


def test_freed_cached_block_stays_findable_and_can_be_revived() -> None:
    pool = BlockPool(3)
    (b,) = pool.allocate(1)
    pool.register(b, 1234, (1, 2, 3))
    pool.release([b])
    assert pool.num_free == 3
    assert pool.lookup(1234, (1, 2, 3)) is b  # freed but still cached
    pool.touch([b])  # revive
    assert b.ref_count == 1
    assert pool.num_free == 2
    # the revived block is not in the free list any more: the others are handed out, not it
    others = pool.allocate(2)
    assert b not in others
    with pytest.raises(RuntimeError):
        pool.allocate(1)
    assert pool.lookup(1234, (1, 2, 3)) is b


def test_cached_block_is_evicted_only_when_handed_out_again() -> None:
    pool = BlockPool(3)
    b0, b1, b2 = pool.allocate(3)
    pool.register(b0, 7, (7,))
    pool.release([b1, b2, b0])  # b0 freed last: evicted last
    assert ids(pool.allocate(2)) == [1, 2]
    assert pool.lookup(7, (7,)) is b0  # still cached
    (again,) = pool.allocate(1)
    assert again is b0
    assert pool.lookup(7, (7,)) is None
    assert b0.block_hash is None and b0.token_ids is None


def test_hash_collision_is_rejected_by_token_check() -> None:
    pool = BlockPool(2)
    (b,) = pool.allocate(1)
    pool.register(b, 42, (1, 2, 3, 4))
    assert pool.lookup(42, (9, 9, 9, 9)) is None  # same hash, other tokens
    assert pool.lookup(42, (1, 2, 3, 4)) is b
    assert pool.lookup(43, (1, 2, 3, 4)) is None


def test_register_first_block_with_a_hash_wins() -> None:
    pool = BlockPool(2)
    a, b = pool.allocate(2)
    pool.register(a, 5, (1,))
    pool.register(b, 5, (1,))
    assert pool.lookup(5, (1,)) is a
    assert b.block_hash is None
    # a block already registered keeps its first hash
    pool.register(a, 6, (2,))
    assert a.block_hash == 5 and pool.lookup(6, (2,)) is None


def test_reset_prefix_cache_forgets_everything() -> None:
    pool = BlockPool(2)
    a, b = pool.allocate(2)
    pool.register(a, 1, (1,))
    pool.release([a])
    pool.register(b, 2, (2,))
    pool.reset_prefix_cache()
    assert pool.lookup(1, (1,)) is None and pool.lookup(2, (2,)) is None
    assert a.block_hash is None and b.block_hash is None
    assert pool.num_free == 1 and b.ref_count == 1
