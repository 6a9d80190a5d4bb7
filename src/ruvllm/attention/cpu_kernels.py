"""Our C++ CPU kernels (csrc/), compiled on first use with the machine's C++ compiler.

Built once per source version and CPU (torch's extension cache, ~35 s on 2 cores; needs a C++
compiler, and ninja, which is a dependency), then loaded in well under a second. Where no compiler is present or the build fails, callers get None and
keep the plain PyTorch path, which computes the same thing more slowly.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import platform
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import torch

log = logging.getLogger(__name__)

_CSRC = Path(__file__).parent / "csrc"


def _build_tag(source: Path) -> str:
    """-march=native code must not be reused on another CPU sharing the same cache folder, and two
    checkouts must not rebuild over each other: the CPU's flags, the source and its path go in the
    name (torch's build file records the source's path, so even identical sources at two paths
    would recompile each time the other one had been loaded)."""
    try:
        flags = next((line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")), "")
    except OSError:
        flags = platform.processor()
    return hashlib.sha1(flags.encode() + str(source.resolve()).encode() + source.read_bytes()).hexdigest()[:12]


@functools.cache
def _extension():
    from torch.utils.cpp_extension import load

    # -ffast-math lets the softmax's exp loop vectorize; the kernel keeps inf and NaN out of it.
    flags = ["-O3", "-march=native", "-fopenmp", "-ffast-math"]
    log.info("loading the C++ attention kernel (compiled on first use: ~35 s once per version and CPU)")
    source = _CSRC / "paged_attention.cpp"
    return load(name=f"ruvllm_paged_attention_{_build_tag(source)}", sources=[str(source)],
                extra_cflags=flags, extra_ldflags=["-fopenmp"], verbose=False)


@functools.cache
def paged_attention() -> Callable[..., torch.Tensor] | None:
    """The compiled paged-attention kernel, or None (with one warning) when it cannot be built."""
    try:
        return _extension().paged_attention
    except Exception as e:  # no compiler, no headers, a build error: fall back, say why once
        log.warning("C++ attention kernel unavailable, using the PyTorch path (%s: %s)", type(e).__name__,
                    str(e).strip().splitlines()[-1] if str(e).strip() else "")
        return None


@functools.cache
def cold_tier_kernels() -> SimpleNamespace | None:
    """The same extension's kernels for a quantized KV cache: `attention` (paged attention reading
    cold blocks as int8/int4 codes) and `quantize` (the quantize-copy of hot blocks into cold ones)."""
    if paged_attention() is None:
        return None
    ext = _extension()
    return SimpleNamespace(attention=ext.paged_attention_tiered, quantize=ext.quantize_kv_blocks)
