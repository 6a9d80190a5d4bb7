"""Sizing the KV pool on a GPU: what a warm-up at the largest step leaves of the memory budget.

The budget is gpu_memory_utilization x the GPU's memory. From it go the weights, the peak of a
forward pass at the token budget with sampling at the sequence cap (measured, not estimated), and
what CUDA and other processes hold outside PyTorch's allocator. The rest becomes KV blocks. Start-up
fails, with the numbers, when the weights do not fit or one sequence at the context length does not.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from ruvllm.errors import ModelLoadError
from ruvllm.outputs import ScheduledSeq, SchedulerOutput

log = logging.getLogger(__name__)

GiB = 2**30


class InsufficientGPUMemoryError(ModelLoadError):
    """The model, or one sequence at the context length, does not fit in the GPU memory budget."""


def check_weights_fit(need: int, held_as: str, device: torch.device, utilization: float) -> None:
    """Before loading: `need` bytes of weights (the weight plan's total, held as `held_as`) fit the budget."""
    free, total = torch.cuda.mem_get_info(device)
    budget = min(total * utilization, free)
    if need > budget:
        raise InsufficientGPUMemoryError(
            f"the model's weights need {need / GiB:.2f} GiB ({held_as}), but "
            f"{device} offers {budget / GiB:.2f} GiB ({utilization:.0%} of {total / GiB:.1f} GiB, "
            f"{free / GiB:.1f} GiB free): use a smaller model, a higher --gpu-memory-utilization, or --device cpu")


@dataclass(frozen=True)
class MemoryProfile:
    total: int  # the GPU's memory
    budget: int  # utilization x total
    peak_torch: int  # PyTorch's peak during the warm-up: weights, activations, the warm-up's KV
    warmup_kv: int  # the warm-up pool's bytes, counted in peak_torch but given back after
    outside_torch: int  # CUDA context, other processes

    @property
    def kv_bytes(self) -> int:
        return self.budget - (self.peak_torch - self.warmup_kv) - self.outside_torch


def profile_step_memory(runner, max_tokens: int, max_seqs: int, utilization: float) -> MemoryProfile:
    """Run the largest step this engine schedules (max_tokens prompt tokens, then sampling for
    max_seqs rows) on the runner's small warm-up pool and measure the peak."""
    dev = runner.device
    torch.cuda.synchronize(dev)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(dev)
    bs = runner.block_size
    blocks = list(range((max_tokens + bs - 1) // bs))
    if len(blocks) > runner.num_blocks:
        raise ValueError(f"warm-up pool of {runner.num_blocks} blocks cannot hold {max_tokens} tokens")
    so = SchedulerOutput([ScheduledSeq("profile", [0] * max_tokens, 0, blocks, sample=True)])
    with torch.inference_mode():
        hidden = runner.forward(so)
        # The last row, once per sequence the sampler may see (through the runner, which a
        # tensor-parallel rank 0 announces to the other ranks).
        logits = runner._logits(hidden, [max_tokens - 1] * min(max_seqs, max_tokens))
        logits.softmax(dim=-1).sort(dim=-1, descending=True)  # the sampler's widest temporaries
        del hidden, logits
    torch.cuda.synchronize(dev)
    free, total = torch.cuda.mem_get_info(dev)
    kv = runner.kv_cache
    return MemoryProfile(
        total=total,
        budget=int(total * utilization),
        peak_torch=torch.cuda.max_memory_allocated(dev),
        warmup_kv=kv.numel() * kv.element_size(),
        outside_torch=(total - free) - torch.cuda.memory_reserved(dev),
    )


def kv_blocks_from_profile(profile: MemoryProfile, bytes_per_block: int, block_size: int,
                           max_model_len: int) -> int:
    blocks = max(profile.kv_bytes, 0) // bytes_per_block
    numbers = (f"budget {profile.budget / GiB:.2f} GiB of {profile.total / GiB:.1f} GiB; weights and "
               f"activations peak at {(profile.peak_torch - profile.warmup_kv) / GiB:.2f} GiB; "
               f"{profile.outside_torch / GiB:.2f} GiB held outside PyTorch")
    if blocks * block_size < max_model_len:
        raise InsufficientGPUMemoryError(
            f"the KV cache would hold {blocks * block_size} tokens, fewer than one sequence at the context "
            f"length ({max_model_len}) needs ({numbers}): lower --max-context or --max-num-batched-tokens, "
            "or raise --gpu-memory-utilization")
    log.info("KV pool sized by profiling: %d blocks (%d tokens); %s", blocks, blocks * block_size, numbers)
    return int(blocks)
