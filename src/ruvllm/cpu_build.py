"""Building our C++ CPU kernels (attention/csrc, quant/csrc) on first use with the machine's compiler.

Each extension is built once per source version, path and CPU (torch's extension cache, ~35 s on 2
cores; needs a C++ compiler, and ninja, which is a dependency), then loaded in well under a second.
Callers catch the failure to build and keep their plain PyTorch path.
"""

from __future__ import annotations

import hashlib
import logging
import platform
from pathlib import Path
from types import ModuleType

log = logging.getLogger(__name__)

# -march=native: the CPU's own vector instructions (AVX2, AVX-512, VNNI) are chosen at build time.
# -ffast-math lets float loops vectorize; the kernels keep inf and NaN out of them.
CFLAGS = ["-O3", "-march=native", "-fopenmp", "-ffast-math"]


def build_tag(source: Path) -> str:
    """-march=native code must not be reused on another CPU sharing the same cache folder, and two
    checkouts must not rebuild over each other: the CPU's flags, the source and its path go in the
    name (torch's build file records the source's path, so even identical sources at two paths
    would recompile each time the other one had been loaded)."""
    try:
        flags = next((line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")), "")
    except OSError:
        flags = platform.processor()
    return hashlib.sha1(flags.encode() + str(source.resolve()).encode() + source.read_bytes()).hexdigest()[:12]


def build(name: str, source: Path, what: str, cflags: list[str] = CFLAGS) -> ModuleType:
    """The extension `name` compiled from `source` (raises when it cannot be built)."""
    from torch.utils.cpp_extension import load

    log.info("loading the C++ %s (compiled on first use: ~35 s once per version and CPU)", what)
    return load(name=f"{name}_{build_tag(source)}", sources=[str(source)], extra_cflags=cflags,
                extra_ldflags=["-fopenmp"], verbose=False)


def unavailable(what: str, error: Exception) -> None:
    """Say once why a kernel could not be built (no compiler, no headers, a build error)."""
    text = str(error).strip()
    log.warning("C++ %s unavailable, using the PyTorch path (%s: %s)", what, type(error).__name__,
                text.splitlines()[-1] if text else "")
