"""The data-parallel router (engine/router.py): prefix affinity, the load bound, the consistent hash."""

from __future__ import annotations

import random

import pytest

from ruvllm.engine.router import Router, RouterConfig, block_hashes



def _ids(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1000) for _ in range(n)]


def test_block_hashes_chain_over_full_blocks_and_salt() -> None:
    ids = list(range(10))
    h = block_hashes(ids, 4)
    assert len(h) == 2  # 10 tokens: two full blocks, the partial third not hashed
    assert block_hashes(ids[:8] + [99, 98], 4) == h  # only full blocks count
    assert block_hashes([0, 1, 2, 3, 9, 9, 9, 9], 4)[0] == h[0] != block_hashes([0, 1, 2, 3, 9, 9, 9, 9], 4)[1]
    assert block_hashes(ids, 4, salt="tenant-a") != h  # another tenant's prompt never matches


def test_a_conversation_stays_on_the_replica_that_holds_its_prefix() -> None:
    router = Router(4)
    turn1 = _ids(1, 40)
    first = router.choose(turn1, None, {0: 0, 1: 0})
    turn2 = turn1 + _ids(2, 30)  # the next turn starts with the whole first one
    # The other replica is less loaded, within the bound: the prefix wins.
    loads = [1, 0] if first == 0 else [0, 1]
    assert router.choose(turn2, None, dict(enumerate(loads))) == first
    assert router.match_depth(first, block_hashes(turn2 + _ids(3, 8), 4)) == len(turn2) // 4


def test_the_load_bound_spills_a_hot_prefix() -> None:
    """Every chat begins with the same system prompt: a replica already above the bound takes none."""
    router = Router(4, RouterConfig(load_factor=1.25))
    system = _ids(0, 16)
    first = router.choose(system + _ids(1, 9), None, {0: 0, 1: 0})
    other = 1 - first
    loads = [0, 0]
    loads[first] = 6  # bound: ceil(1.25 x 7 / 2) = 5; 6 + 1 > 5: spilled, though only `first` holds the prefix
    assert router.choose(system + _ids(2, 9), None, dict(enumerate(loads))) == other
    loads = [0, 0]
    loads[first] = 3  # 3 + 1 <= ceil(1.25 x 4 / 2) = 3? no: 4 > 3, spilled again
    assert router.choose(system + _ids(3, 9), None, dict(enumerate(loads))) == other
    # Both hold the system prompt now: among equal matches the less loaded one takes it.
    assert router.choose(system + _ids(4, 9), None, {0: 2, 1: 1}) == 1
    fresh = Router(4, RouterConfig(load_factor=1.25))
    where = fresh.choose(system + _ids(1, 9), None, {0: 0, 1: 0})
    loads = [0, 0]
    loads[where], loads[1 - where] = 5, 4  # 5 + 1 <= ceil(1.25 x 10 / 2) = 7: the prefix keeps it
    assert fresh.choose(system + _ids(5, 9), None, dict(enumerate(loads))) == where


def test_new_prefixes_follow_a_consistent_hash_that_only_moves_a_dead_replicas_share() -> None:
    prompts = [_ids(100 + i, 20) for i in range(200)]
    three = [Router(4).choose(p, None, {0: 0, 1: 0, 2: 0}) for p in prompts]
    assert set(three) == {0, 1, 2} and max(three.count(r) for r in range(3)) < 120  # spread
    assert three == [Router(4).choose(p, None, {0: 0, 1: 0, 2: 0}) for p in prompts]  # deterministic
    # Replica 2 down: the ring has seen it, so only its share moves (a ring that never saw it would
    # be a different ring, and that is the consistent hash's promise too: only its points are gone).
    seen = Router(4)
    seen.choose(prompts[0], None, {0: 0, 1: 0, 2: 0})
    without_2 = [seen.choose(p, None, {0: 0, 1: 0}) for p in prompts]
    assert all(b == a for a, b in zip(three, without_2) if a != 2)  # only replica 2's prompts moved
    assert 2 not in without_2


def test_least_loaded_and_round_robin() -> None:
    ll = Router(4, RouterConfig(policy="least_loaded"))
    assert ll.choose(_ids(1, 20), None, {0: 3, 1: 1.5, 2: 1.2}) == 2  # 1 sequence each; KV use decides
    assert ll.choose(_ids(1, 20), None, {0: 3, 1: 1.5}) == 1
    rr = Router(4, RouterConfig(policy="round_robin"))
    assert [rr.choose(_ids(1, 20), None, {0: 0, 1: 0, 2: 0}) for _ in range(6)] == [0, 1, 2, 0, 1, 2]


def test_a_restarted_replica_is_forgotten_and_none_usable_is_an_error() -> None:
    router = Router(4)
    p = _ids(5, 40)
    r = router.choose(p, None, {0: 0, 1: 0})
    router.forget(r)
    assert router.match_depth(r, block_hashes(p, 4)) == 0
    with pytest.raises(RuntimeError, match="no replica"):
        router.choose(p, None, {})


def test_bad_config_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="policy must be one of prefix, least_loaded, round_robin"):
        RouterConfig(policy="random")
    with pytest.raises(ValueError, match="load_factor"):
        RouterConfig(load_factor=0.5)
