"""Our C++ attention kernels (csrc/), compiled on first use (ruvllm/cpu_build.py). Where no compiler
is present or the build fails, callers get None and keep the plain PyTorch path, which computes the
same thing more slowly.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from types import SimpleNamespace

import torch

from ruvllm.cpu_build import kernels


def paged_attention() -> Callable[..., torch.Tensor] | None:
    """The compiled paged-attention kernel, or None when the kernels cannot be built."""
    ext = kernels()
    return None if ext is None else ext.paged_attention


@functools.cache
def cold_tier_kernels() -> SimpleNamespace | None:
    """The same extension's kernels for a quantized KV cache: `attention` (paged attention reading
    cold blocks as int8/int4 codes) and `quantize` (the quantize-copy of hot blocks into cold ones)."""
    ext = kernels()
    if ext is None:
        return None
    return SimpleNamespace(attention=ext.paged_attention_tiered, quantize=ext.quantize_kv_blocks)
