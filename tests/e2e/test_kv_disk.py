"""The disk KV tier on the default model (fp32): blocks served from disk give the same greedy tokens
and logprobs as computing them, in the same engine and after a restart; a damaged block file is
skipped with a warning, never served; another tenant's blocks are never read; serving goes on when
the tier cannot write. A "restart" is a new engine (its own pool, scheduler and store) over the
same loaded model and folder: nothing in memory survives but the weights."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from ruvllm import LLM, SamplingParams
from ruvllm.config import CacheConfig
from ruvllm.core.disk_index import chain_key, chain_seed
from ruvllm.tenants import tenant_salt
from tests.conftest import novel_prompts

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, logprobs=3)
BLOCK = 16


@pytest.fixture(scope="module")
def prompts(_shared_llm: LLM) -> tuple[list[int], list[int]]:
    """A: 136 tokens (8 full blocks before its last token); B: 260 other tokens."""
    tok = _shared_llm.tokenizer
    a, b = novel_prompts(2, words=400)
    return tok.encode(a)[:136], tok.encode(b)[:260]


@pytest.fixture(scope="module")
def reference(_shared_llm: LLM, prompts: tuple[list[int], list[int]]):
    """Prompt A computed in full (no cached block) by the shared fp32 engine."""
    _shared_llm.reset_prefix_cache()
    return _shared_llm.generate(prompts[0], GREEDY)[0].outputs[0]


def engine(llm: LLM, folder: Path, num_blocks: int = 64, **cache: object) -> LLM:
    return llm.with_settings(cache=CacheConfig(num_blocks=num_blocks, kv_disk_path=str(folder), **cache))


def finish(e: LLM) -> None:
    """Every block back in the pool, then the engine closed (its cached blocks written)."""
    s = e.stats()
    assert s.idle and s.free_blocks == s.total_blocks, "KV blocks leaked"
    e.close()


def same(out, ref) -> None:
    assert out.token_ids == ref.token_ids
    assert out.logprobs == ref.logprobs  # bitwise: every float of every top-3 entry


def block_file(e: LLM, tokens: list[int], i: int, tenant: str = "default") -> Path:
    """Block i's file: its key chains the engine's fingerprint, the tenant's salt and blocks 0..i."""
    store = e.core.executor.kv_disk
    key = chain_seed(store.fingerprint, tenant_salt(tenant))
    for j in range(i + 1):
        key = chain_key(key, tokens[j * BLOCK:(j + 1) * BLOCK])
    return store.folder / (key.hex() + ".kvb")


def test_evicted_blocks_come_back_from_disk_equal_to_recompute(llm: LLM, prompts, reference, tmp_path: Path) -> None:
    a, b = prompts
    e = engine(llm, tmp_path, num_blocks=20)
    first = e.generate(a, GREEDY)[0]
    same(first.outputs[0], reference)
    e.generate(b, GREEDY)  # B's 17 blocks take A's least recently freed blocks: its tail goes to disk
    e.core.executor.kv_disk.flush()
    s0 = e.stats()
    assert s0.disk_bytes > 0
    again = e.generate(a, GREEDY)[0]
    s = e.stats()
    loaded = s.disk_hits - s0.disk_hits
    assert loaded > 0 and s.prefix_hits - s0.prefix_hits > 0  # A's head from memory, its tail from disk
    assert again.num_cached_tokens == 8 * BLOCK  # cached_tokens counts both tiers
    same(again.outputs[0], reference)
    finish(e)


def test_a_restart_serves_the_prefix_from_disk(llm: LLM, prompts, reference, tmp_path: Path) -> None:
    a, _ = prompts
    e = engine(llm, tmp_path)
    e.generate(a, GREEDY)
    finish(e)  # closing writes the cached blocks: the prefix cache outlives the engine
    r = engine(llm, tmp_path)
    out = r.generate(a, GREEDY)[0]
    s = r.stats()
    assert out.num_cached_tokens == 8 * BLOCK and s.disk_hits == 8 * BLOCK and s.prefix_hits == 0
    same(out.outputs[0], reference)
    finish(r)


def test_damaged_block_files_are_skipped_never_served(llm: LLM, prompts, reference, tmp_path: Path,
                                                      caplog: pytest.LogCaptureFixture) -> None:
    a, _ = prompts
    e = engine(llm, tmp_path)
    e.generate(a, GREEDY)
    finish(e)
    for damage, at in (("truncate", 6), ("flip", 2)):
        r = engine(llm, tmp_path)
        path = block_file(r, a, at)
        raw = bytearray(path.read_bytes())
        if damage == "truncate":  # a write cut short
            path.write_bytes(raw[:len(raw) // 2])
        else:  # one bit flipped in the K/V
            raw[len(raw) // 2] ^= 0x01
            path.write_bytes(raw)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="ruvllm.worker.kv_disk"):
            out = r.generate(a, GREEDY)[0]
        assert out.num_cached_tokens == at * BLOCK, damage  # the blocks before it, and no further
        assert f"{path.name} skipped" in caplog.text
        same(out.outputs[0], reference)
        finish(r)  # (the recomputed blocks are written again at close)


def test_another_tenants_blocks_are_never_read(llm: LLM, prompts, reference, tmp_path: Path) -> None:
    a, _ = prompts
    e = engine(llm, tmp_path)
    e.generate(a, GREEDY, tenant="alice")
    finish(e)
    r = engine(llm, tmp_path)
    bob = r.generate(a, GREEDY, tenant="bob")[0]
    s = r.stats()
    assert bob.num_cached_tokens == 0 and s.disk_hits == 0 and r.core.executor.kv_disk.stats.loaded == 0
    same(bob.outputs[0], reference)
    alice = r.generate(a, GREEDY, tenant="alice")[0]  # her own blocks are there
    assert alice.num_cached_tokens == 8 * BLOCK and r.stats().disk_hits == 8 * BLOCK
    same(alice.outputs[0], reference)
    finish(r)


def test_serving_goes_on_without_a_tier_that_cannot_write(llm: LLM, prompts, reference, tmp_path: Path,
                                                          caplog: pytest.LogCaptureFixture) -> None:
    a, _ = prompts
    tiny = engine(llm, tmp_path / "tiny", kv_disk_bytes=4096)  # no block file fits
    same(tiny.generate(a, GREEDY)[0].outputs[0], reference)
    folder = tiny.core.executor.kv_disk.folder
    finish(tiny)  # (closing tries to write every cached block)
    assert not list(folder.glob("*.kvb"))
    blocked = tmp_path / "file"
    blocked.write_text("a file where the folder should be")
    with caplog.at_level(logging.WARNING, logger="ruvllm.worker.kv_disk"):
        off = engine(llm, blocked / "kv")
    assert off.core.executor.kv_disk is None and "disk KV tier off" in caplog.text
    same(off.generate(a, GREEDY)[0].outputs[0], reference)
    finish(off)


def test_combinations_it_cannot_serve_are_refused_by_name(llm: LLM, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="int8 KV cache"):
        engine(llm, tmp_path, kv_cache_dtype="int8")
    with pytest.raises(ValueError, match="needs prefix caching"):
        engine(llm, tmp_path, enable_prefix_caching=False)
    assert not list(tmp_path.iterdir())  # refused before anything was written
