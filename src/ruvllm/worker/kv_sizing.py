"""How many KV blocks a pool holds, and what a block costs: pure functions of the model's shape and
the cache settings, shared by the worker (which allocates the pool) and the CLI (`ruvllm info`,
`ruvllm benchmark`), so the two never disagree."""

from __future__ import annotations

import torch

from ruvllm.attention.kv_quant import KV_BITS, cold_bytes_per_row
from ruvllm.config import DEFAULT_CPU_KV_CACHE_BYTES, CacheConfig, ModelConfig, SchedulerConfig
from ruvllm.kv_groups import kv_layout


def kv_bytes_per_block(cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """A block holds K and V of block_size tokens for the layers of one KV group (all of them, for a
    model without sliding-window layers: kv_groups.py)."""
    elem = torch.tensor([], dtype=dtype).element_size()
    return 2 * kv_layout(cfg).group_size * block_size * cfg.num_kv_heads * cfg.head_dim * elem


def cold_kv_bytes_per_block(cfg: ModelConfig, block_size: int, bits: int) -> int:
    return 2 * kv_layout(cfg).group_size * block_size * cfg.num_kv_heads * cold_bytes_per_row(cfg.head_dim, bits)


def num_kv_blocks(cfg: ModelConfig, cache: CacheConfig, dtype: torch.dtype) -> int:
    """Blocks in the pool when its size is given (a block count, or bytes; default 1 GiB)."""
    if cache.num_blocks is not None:
        return cache.num_blocks
    budget = cache.kv_cache_memory_bytes or DEFAULT_CPU_KV_CACHE_BYTES
    n = budget // kv_bytes_per_block(cfg, cache.block_size, dtype)
    if n < 1:
        raise ValueError(f"kv_cache_memory_bytes={budget} holds no block of "
                         f"{kv_bytes_per_block(cfg, cache.block_size, dtype)} bytes")
    return int(n)


def hot_blocks_wanted(cache: CacheConfig, sched: SchedulerConfig, max_model_len: int) -> tuple[int, int]:
    """Hot blocks a two-tier cache wants (every running sequence's hot window plus one step's new
    tokens) and needs (one sequence's window plus one step: a request running alone always fits).

    After a step's migrations a decoding sequence holds at most ceil((hot_tokens - 1) / block_size) + 1
    hot blocks, its next token included; a step writes at most max_num_batched_tokens new tokens."""
    bs = cache.block_size
    per_seq = -(-max(cache.kv_hot_tokens - 1, 0) // bs) + 1
    step = -(-min(sched.max_num_batched_tokens, max_model_len) // bs) + 1
    return sched.max_num_seqs * per_seq + step, per_seq + step


def kv_tier_blocks(cfg: ModelConfig, cache: CacheConfig, sched: SchedulerConfig, dtype: torch.dtype,
                   max_model_len: int) -> tuple[int, int]:
    """(hot blocks, cold blocks) of a pool sized as configured. Without a quantized KV dtype: all hot.

    With int8/int4 the budget (kv_cache_memory_bytes, or num_blocks x a 16-bit block's bytes) first
    gives the hot tier what hot_blocks_wanted asks, at most half of it (but never less than one
    sequence needs), and the rest to cold blocks."""
    if not cache.quantized_kv:
        return num_kv_blocks(cfg, cache, dtype), 0
    hot_bytes = kv_bytes_per_block(cfg, cache.block_size, dtype)
    cold_bytes = cold_kv_bytes_per_block(cfg, cache.block_size, KV_BITS[cache.kv_cache_dtype])
    if cache.num_blocks is not None:
        budget = cache.num_blocks * hot_bytes
    else:
        budget = cache.kv_cache_memory_bytes or DEFAULT_CPU_KV_CACHE_BYTES
    want, need = hot_blocks_wanted(cache, sched, max_model_len)
    hot = max(need, min(want, budget // 2 // hot_bytes))
    cold = (budget - hot * hot_bytes) // cold_bytes
    if cold < 1:
        raise ValueError(
            f"an {cache.kv_cache_dtype} KV cache of {budget / 2**20:.1f} MiB cannot hold its hot tier "
            f"({need} blocks of {hot_bytes / 2**20:.2f} MiB: the hot window of {cache.kv_hot_tokens} tokens "
            f"plus one step of {sched.max_num_batched_tokens} tokens) and any cold block; give it more memory "
            "(kv_cache_memory_bytes / --kv-cache-gib), or lower kv_hot_tokens or max_num_batched_tokens")
    return hot, int(cold)


def kv_capacity_ratio(cfg: ModelConfig, block_size: int, dtype: torch.dtype, kv_cache_dtype: str, hot: int,
                      cold: int) -> float:
    """Tokens the two tiers hold / tokens a cache all in `dtype` would hold in the same bytes."""
    if not cold:
        return 1.0
    hot_bytes = kv_bytes_per_block(cfg, block_size, dtype)
    used = hot * hot_bytes + cold * cold_kv_bytes_per_block(cfg, block_size, KV_BITS[kv_cache_dtype])
    return (hot + cold) * hot_bytes / used
