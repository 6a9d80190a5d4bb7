"""Our multi-adapter LoRA kernel (lora/csrc/lora_add.cpp) against the PyTorch ops computing the same
deltas, and each row's delta the same alone as in any batch (the engine's invariant)."""

from __future__ import annotations

import pytest
import torch

from ruvllm.lora.batch import LoraBatch, lora_add_torch, lora_kernel
from ruvllm.lora.slots import LoraSlots
from tests.engine_fixtures import TINY_GQA

KERNEL = lora_kernel()
pytestmark = pytest.mark.skipif(KERNEL is None, reason="the C++ kernels did not build here")


def random_slots(max_loras: int = 3, max_rank: int = 8) -> LoraSlots:
    slots = LoraSlots(TINY_GQA, max_loras, max_rank, torch.float32)
    g = torch.Generator().manual_seed(0)
    for layer in slots.layers:
        for p in layer.values():
            p.A.normal_(generator=g)
            p.B.normal_(generator=g)
            # ranks 0 (no LoRA on that projection) to the maximum, rows past a rank must be skipped
            p.ranks.copy_(torch.randint(0, max_rank + 1, p.ranks.shape, generator=g, dtype=torch.int32))
    return slots


@pytest.mark.parametrize("fused", ["qkv", "o", "gate_up", "down"])
def test_kernel_matches_torch_and_rows_alone(fused: str) -> None:
    slots = random_slots()
    p = slots.layers[1][fused]
    g = torch.Generator().manual_seed(1)
    T, K, N = 37, p.A.shape[2], p.B.shape[2]
    rows = torch.randint(-1, 3, (T,), generator=g).tolist()
    x = torch.randn(T, K, generator=g)
    y0 = torch.randn(T, N, generator=g)
    ours, ref = y0.clone(), y0.clone()
    LoraBatch(slots, rows, KERNEL).add(1, fused, x, ours)
    lora_add_torch(ref, x, p, rows)
    assert (ours - ref).abs().max() < 1e-4 * (ref - y0).abs().max()
    assert torch.equal(ours[[t for t, s in enumerate(rows) if s == -1]], y0[[t for t, s in enumerate(rows) if s == -1]])
    for t in range(T):
        alone = y0[t:t + 1].clone()
        LoraBatch(slots, [rows[t]], KERNEL).add(1, fused, x[t:t + 1].contiguous(), alone)
        assert torch.equal(alone[0], ours[t]), t


def test_rows_past_a_slots_rank_are_not_read() -> None:
    """A slot holding rank 2 of 8: garbage in its unused rows changes nothing."""
    slots = random_slots()
    p = slots.layers[0]["o"]
    p.ranks[0] = 2
    x, y = torch.randn(4, p.A.shape[2]), torch.zeros(4, p.B.shape[2])
    before = y.clone()
    LoraBatch(slots, [0] * 4, KERNEL).add(0, "o", x, before)
    p.A[0, 2:] = float("nan")
    p.B[0, 2:] = float("nan")
    after = y.clone()
    LoraBatch(slots, [0] * 4, KERNEL).add(0, "o", x, after)
    assert torch.equal(before, after)


def test_bad_slot_is_an_error() -> None:
    slots = random_slots()
    p = slots.layers[0]["o"]
    with pytest.raises(RuntimeError, match="slot 5 of 3"):
        KERNEL(torch.zeros(1, p.B.shape[2]), torch.zeros(1, p.A.shape[2]), p.A, p.B, p.ranks,
               torch.tensor([5], dtype=torch.int32), list(p.bounds))


@pytest.mark.parametrize("fused", ["qkv", "gate_up"])
def test_row_weights_scale_each_rows_delta(fused: str) -> None:
    """X-LoRA's per-row weights (one per sub-projection): the kernel matches the PyTorch ops, a
    weight of 1 is the unweighted delta, 0 adds nothing, and each row is the same alone."""
    slots = random_slots()
    p = slots.layers[0][fused]
    g = torch.Generator().manual_seed(2)
    T, K, N, n_sub = 29, p.A.shape[2], p.B.shape[2], len(p.bounds) - 1
    rows = torch.randint(-1, 3, (T,), generator=g, dtype=torch.int32)
    x = torch.randn(T, K, generator=g)
    w = torch.rand(T, n_sub, generator=g)
    w[:5] = 1.0
    w[5:8] = 0.0
    y0 = torch.randn(T, N, generator=g)
    ours, ref, plain = y0.clone(), y0.clone(), y0.clone()
    KERNEL(ours, x, p.A, p.B, p.ranks, rows, list(p.bounds), w)
    lora_add_torch(ref, x, p, rows.tolist(), w)
    KERNEL(plain, x, p.A, p.B, p.ranks, rows, list(p.bounds))
    assert (ours - ref).abs().max() < 1e-4 * (ref - y0).abs().max()
    assert torch.equal(ours[:5], plain[:5]) and torch.equal(ours[5:8], y0[5:8])
    for t in range(T):
        alone = y0[t:t + 1].clone()
        KERNEL(alone, x[t:t + 1].contiguous(), p.A, p.B, p.ranks, rows[t:t + 1].contiguous(), list(p.bounds),
               w[t:t + 1].contiguous())
        assert torch.equal(alone[0], ours[t]), t
