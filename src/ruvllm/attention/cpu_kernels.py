"""Our C++ attention kernels (csrc/), compiled on first use (ruvllm/cpu_build.py). Where no compiler
is present or the build fails, callers get None and keep the plain PyTorch path, which computes the
same thing more slowly.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import torch

from ruvllm.cpu_build import build, unavailable

_CSRC = Path(__file__).parent / "csrc"


@functools.cache
def _extension():
    return build("ruvllm_paged_attention", _CSRC / "paged_attention.cpp", "attention kernel")


@functools.cache
def paged_attention() -> Callable[..., torch.Tensor] | None:
    """The compiled paged-attention kernel, or None (with one warning) when it cannot be built."""
    try:
        return _extension().paged_attention
    except Exception as e:  # no compiler, no headers, a build error: fall back, say why once
        unavailable("attention kernel", e)
        return None


@functools.cache
def cold_tier_kernels() -> SimpleNamespace | None:
    """The same extension's kernels for a quantized KV cache: `attention` (paged attention reading
    cold blocks as int8/int4 codes) and `quantize` (the quantize-copy of hot blocks into cold ones)."""
    if paged_attention() is None:
        return None
    ext = _extension()
    return SimpleNamespace(attention=ext.paged_attention_tiered, quantize=ext.quantize_kv_blocks)
