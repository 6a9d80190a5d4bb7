"""The disk KV tier's parts alone: stable keys, the byte-bounded index, the store's files (written,
read back, rejected when torn), and the KV cache manager naming and spilling evicted blocks."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ruvllm.config import CacheConfig
from ruvllm.core.disk_index import DiskBlock, DiskIndex, chain_key, chain_seed
from ruvllm.core.kv_cache_manager import KVCacheManager
from ruvllm.request import Request
from ruvllm.sampling_params import SamplingParams
from ruvllm.worker.kv_disk import KVDiskStore

SHAPE = (2, 2, 4, 1, 8)  # layers, K/V, block size, KV heads, head dim


def store_at(folder: Path, budget: int = 1 << 20) -> KVDiskStore:
    return KVDiskStore(folder, budget, b"fp", {"test": True}, SHAPE, torch.float32)


def chain(tokens: list[int], salt: str | None = None, bs: int = 4) -> list[DiskBlock]:
    parent, out = chain_seed(b"fp", salt), []
    for i in range(len(tokens) // bs):
        chunk = tuple(tokens[i * bs:(i + 1) * bs])
        key = chain_key(parent, chunk)
        out.append(DiskBlock(key, parent, chunk))
        parent = key
    return out


def blocks_data(n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(SHAPE[0], 2, n * SHAPE[2], *SHAPE[3:], generator=g)


def test_keys_depend_on_fingerprint_salt_and_tokens() -> None:
    seeds = {chain_seed(b"a", None), chain_seed(b"a", ""), chain_seed(b"a", "t"), chain_seed(b"b", None)}
    assert len(seeds) == 4  # None (no salt) and "" are different tenants
    s = chain_seed(b"a", None)
    assert chain_key(s, (1, 2)) != chain_key(s, (2, 1)) != chain_key(chain_seed(b"a", "t"), (2, 1))


def test_keys_are_the_same_in_another_process() -> None:
    """The in-memory cache hashes with Python's per-process seed; disk keys must survive a restart."""
    code = ("from ruvllm.core.disk_index import chain_key, chain_seed;"
            "print(chain_key(chain_seed(b'fp', 'tenant'), (5, 6, 7)).hex())")
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == chain_key(chain_seed(b"fp", "tenant"), (5, 6, 7)).hex()


def test_index_evicts_least_recently_used_past_its_budget() -> None:
    index = DiskIndex(budget=30)
    assert index.add(b"a", 10) == [] and index.add(b"b", 10) == [] and index.add(b"c", 10) == []
    assert index.touch(b"a")  # a is now the most recently used
    assert index.add(b"d", 10) == [b"b"]
    assert b"b" not in index and b"a" in index and index.bytes_used == 30
    assert index.add(b"huge", 31) is None and b"huge" not in index  # a file alone past the budget
    assert not index.touch(b"missing")


def test_store_round_trip_and_rebuild(tmp_path: Path) -> None:
    store = store_at(tmp_path)
    names = chain(list(range(12)))
    data = blocks_data(3)
    store.spill(data, names)
    store.flush()
    assert store.stats.written == 3 and all(n.key in store.index for n in names)
    staged = store.fetch(names).result()
    assert staged.num_blocks == 3
    assert torch.equal(torch.cat(staged.blocks, dim=2), data)
    store.close()
    again = store_at(tmp_path)  # a restart: the index comes from the folder
    assert len(again.index) == 3 and again.index.bytes_used == store.index.bytes_used
    assert torch.equal(torch.cat(again.fetch(names).result().blocks, dim=2), data)
    again.close()


@pytest.mark.parametrize("damage", ["flip", "truncate", "tokens"])
def test_damaged_file_is_skipped_deleted_and_ends_the_run(tmp_path: Path, damage: str,
                                                          caplog: pytest.LogCaptureFixture) -> None:
    store = store_at(tmp_path)
    names = chain(list(range(12)))
    store.spill(blocks_data(3), names)
    store.flush()
    path = tmp_path / (names[1].key.hex() + ".kvb")
    raw = bytearray(path.read_bytes())
    asked = names
    if damage == "flip":
        raw[len(raw) // 2] ^= 0x40
        path.write_bytes(raw)
    elif damage == "truncate":
        path.write_bytes(raw[:len(raw) - 100])
    else:  # a file under the right key holding other tokens: the request's tokens are checked
        asked = [names[0], DiskBlock(names[1].key, names[1].parent, (99, 98, 97, 96)), names[2]]
    with caplog.at_level(logging.WARNING, logger="ruvllm.worker.kv_disk"):
        staged = store.fetch(asked).result()
    assert staged.num_blocks == 1  # the run ends at the bad block: never served
    assert store.stats.rejected == 1 and names[1].key not in store.index and not path.exists()
    assert "skipped" in caplog.text
    store.close()


def test_budget_keeps_the_folder_bounded(tmp_path: Path) -> None:
    one = store_at(tmp_path / "probe")
    one.spill(blocks_data(1), chain([10, 11, 12, 13]))  # (two-digit ids: every file of the test has one size)
    one.flush()
    size = one.index.bytes_used
    one.close()
    store = store_at(tmp_path / "tier", budget=2 * size)
    names = chain(list(range(10, 22)))
    store.spill(blocks_data(3), names)
    store.flush()
    assert names[0].key not in store.index and names[2].key in store.index
    assert sorted(p.name for p in (tmp_path / "tier").glob("*.kvb")) == sorted(n.key.hex() + ".kvb" for n in names[1:])
    store.close()
    tiny = store_at(tmp_path / "tiny", budget=size - 1)  # no block fits: nothing is kept
    tiny.spill(blocks_data(1), chain([10, 11, 12, 13]))
    tiny.flush()
    assert len(tiny.index) == 0 and not list((tmp_path / "tiny").glob("*.kvb"))
    tiny.close()


def test_a_failed_write_stops_the_tier_not_the_caller(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    store = store_at(tmp_path / "tier")
    (tmp_path / "tier" / "fingerprint.json").unlink()
    (tmp_path / "tier").rmdir()  # the folder is gone (a disk unmounted, cleaned up): writes fail
    with caplog.at_level(logging.WARNING, logger="ruvllm.worker.kv_disk"):
        store.spill(blocks_data(2), chain(list(range(8))))
        store.flush()
    assert not store.writable and "no more blocks are written" in caplog.text
    store.spill(blocks_data(1), chain([9, 9, 9, 9]))  # later spills are dropped at once
    assert store.stats.dropped >= 2
    store.close()


def test_unusable_folder_is_refused_by_opening() -> None:
    with pytest.raises(OSError):
        store_at(Path("/proc/ruvllm-kv-disk"))


def test_config_needs_a_folder_for_a_budget() -> None:
    with pytest.raises(ValueError, match="kv_disk_path"):
        CacheConfig(kv_disk_bytes=1 << 30)
    assert CacheConfig().kv_disk_budget == 0 and CacheConfig(kv_disk_path="/x").kv_disk_budget == 8 << 30
    from ruvllm.cli.engine_options import engine_settings, flag_names

    flags = {f for d in engine_settings() for f in flag_names(d)}
    assert {"--kv-disk-path", "--kv-disk-gib"} <= flags


def _request(rid: str, tokens: list[int], salt: str | None = None) -> Request:
    return Request(request_id=rid, prompt_token_ids=tokens, params=SamplingParams(max_tokens=1), eos_token_ids=(),
                   salt=salt)


def test_manager_spills_evicted_cached_blocks_named_by_their_chain(tmp_path: Path) -> None:
    store = KVDiskStore(tmp_path, 1 << 20, b"fp", {}, SHAPE, torch.float32)
    kv = KVCacheManager(4, 4, True, disk=store)
    a = _request("a", list(range(9)), salt="t")  # 2 full blocks and one token
    assert kv.allocate_slots(a, 9)
    a.num_computed_tokens = 9
    kv.cache_full_blocks(a)
    kv.free(a)
    assert kv.take_spills() == []  # freed but still cached: nothing evicted yet
    b = _request("b", [50 + i for i in range(16)])
    assert kv.allocate_slots(b, 16)  # takes every block: a's two cached ones are evicted
    spills = kv.take_spills()
    # (the tail block was freed first, so it goes first)
    assert sorted((d for _, d in spills), key=lambda d: d.token_ids) == chain(list(range(8)), salt="t")
    # A block already on disk is not written again, only marked used.
    store.spill(blocks_data(2), [d for _, d in spills])
    store.flush()
    kv.free(b)
    a2 = _request("a2", list(range(9)), salt="t")
    assert kv.disk_lookup(a2, 0) == chain(list(range(8)), salt="t")
    assert kv.disk_lookup(_request("other", list(range(9)), salt="u"), 0) == []  # another tenant: no key
    store.close()


def test_models_it_cannot_serve_are_refused_by_name(tmp_path: Path) -> None:
    """Gemma 3's several KV groups (and weights from code, which no file names) are refused before
    anything is written; the quantized cold tier is refused on the real model (tests/e2e/test_kv_disk.py)."""
    import dataclasses

    from ruvllm.engine.llm import build_engine_config
    from ruvllm.models.random_weights import random_weights
    from ruvllm.worker.worker import Worker
    from tests.engine_fixtures import TINY_GQA

    config = build_engine_config(dtype="float32", num_blocks=16, kv_disk_path=str(tmp_path))
    gemma = dataclasses.replace(TINY_GQA, architecture="gemma3", sliding_layers=(0,), sliding_window=8)
    with pytest.raises(ValueError, match="gemma3 has sliding-window layers .* one KV group only"):
        Worker.from_weights(gemma, lambda dt: random_weights(gemma, dt, "cpu"), config)
    with pytest.raises(ValueError, match="needs a model loaded from files"):
        Worker.from_weights(TINY_GQA, lambda dt: random_weights(TINY_GQA, dt, "cpu"), config)
    assert not list(tmp_path.iterdir())
