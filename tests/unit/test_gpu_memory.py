"""The KV-pool sizing arithmetic of worker/gpu_memory.py (pure functions: no GPU needed)."""

from __future__ import annotations

import pytest
import torch

from ruvllm.config import QuantConfig
from ruvllm.models.weight_plan import float_weight_plan
from ruvllm.worker.gpu_memory import GiB, InsufficientGPUMemoryError, MemoryProfile, kv_blocks_from_profile
from tests.engine_fixtures import TINY_GQA


def test_blocks_are_what_the_budget_leaves() -> None:
    p = MemoryProfile(total=80 * GiB, budget=72 * GiB, peak_torch=20 * GiB, warmup_kv=1 * GiB, outside_torch=2 * GiB)
    assert p.kv_bytes == 51 * GiB  # 72 - (20 - 1) - 2
    assert kv_blocks_from_profile(p, bytes_per_block=2**20, block_size=16, max_model_len=8192) == 51 * 1024


def test_a_pool_smaller_than_one_sequence_fails_with_the_numbers() -> None:
    p = MemoryProfile(total=80 * GiB, budget=40 * GiB, peak_torch=39 * GiB, warmup_kv=0, outside_torch=3 * GiB // 4)
    with pytest.raises(InsufficientGPUMemoryError) as err:
        kv_blocks_from_profile(p, bytes_per_block=2**20, block_size=16, max_model_len=8192)
    msg = str(err.value)
    assert "would hold 4096 tokens" in msg  # 0.25 GiB of 1 MiB blocks of 16 tokens
    assert "fewer than one sequence at the context length (8192)" in msg
    assert "budget 40.00 GiB of 80.0 GiB" in msg and "--gpu-memory-utilization" in msg


def test_the_weight_plan_counts_every_matrix() -> None:
    """The bytes checked against the GPU budget before loading (the weight plan's total)."""
    c = TINY_GQA
    per_layer = 128 * (128 + 2 * 64) + 128 * 128 + 3 * 128 * 256 + 2 * 128
    plan = float_weight_plan(c, QuantConfig("none"), torch.bfloat16)
    assert plan.total_bytes == 2 * (2 * 512 * 128 + 2 * per_layer + 128)
    assert plan.linear_forms() == {"dense bfloat16": 2 * 4 + (0 if c.tie_word_embeddings else 1)}
