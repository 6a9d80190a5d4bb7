"""Building our C++ CPU kernels (attention/, layers/, quant/csrc; made operators by csrc/ops.cpp) on first use
with the machine's compiler.

They are one extension: compiling torch's headers is most of a build, so one build serves all, and
those headers are precompiled once per environment (csrc/torch_headers.h). It is built once per
source version, path and CPU (torch's extension cache; needs a C++ compiler, and ninja, which is a
dependency), then loaded in well under a second. Callers get
None where it cannot be built, and keep their plain PyTorch paths. Set-up (`python -I
src/ruvllm/cpu_build.py`) and a first use build with the same command, so either reuses the other's
build (TORCH_EXTENSIONS_DIR moves the cache).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import os
import platform
import re
import sysconfig
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

# -march: the instructions the kernels use are chosen at build time, never at run time: the CPU's own
# (native: AVX2, AVX-512, VNNI where present) unless RUVLLM_KERNEL_ARCH names another gcc target, as
# scripts/test_isa.sh does to test each path on one machine ("x86-64": the plain C++ paths any x86-64
# runs; "x86-64-v3": AVX2 and FMA; "sapphirerapids": AVX-512 VNNI as well).
# -ffast-math lets float loops vectorize; the kernels keep inf and NaN out of them.
ARCH = os.environ.get("RUVLLM_KERNEL_ARCH", "native")
CFLAGS = ["-O3", f"-march={ARCH}", "-fopenmp", "-ffast-math"]
# How long a start waits for another process's build before it runs the PyTorch paths: no build
# takes 15 minutes, so a holder past this is hung.
BUILD_WAIT_S = 900.0


_ROOT = Path(__file__).resolve().parent
# The extension's two translation units, each a list of our sources (`#include "....cpp"`): one unit
# per source paid torch's precompiled headers fifteen times (csrc/loops_unit.cpp says what this
# saves). csrc/ops.cpp, in the first, registers every source's functions as operators.
SOURCES = (_ROOT / "csrc" / "loops_unit.cpp", _ROOT / "csrc" / "kernels_unit.cpp")


def unit_sources(unit: Path) -> tuple[Path, ...]:
    """The sources a translation unit includes."""
    return tuple((unit.parent / name).resolve()
                 for name in re.findall(r'^#include "([^"]+\.cpp)"', unit.read_text(), re.MULTILINE))


# Headers and sources the units include: hashed into the build's name with them, so an edit to one
# rebuilds. torch_headers.h is every source's torch headers, precompiled once (_precompiled_header).
PCH_HEADER = _ROOT / "csrc" / "torch_headers.h"
HEADERS = (_ROOT / "csrc" / "kernels.h", _ROOT / "csrc" / "vec.h", PCH_HEADER,
           *(source for unit in SOURCES for source in unit_sources(unit)))


def build_tag(sources: tuple[Path, ...]) -> str:
    """-march=native code must not be reused on another CPU sharing the same cache folder, and two
    checkouts must not rebuild over each other: the CPU's flags, the sources and their paths go in
    the name (torch's build file records the sources' paths, so even identical sources at two paths
    would recompile each time the other one had been loaded)."""
    try:
        flags = next((line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")), "")
    except OSError:
        flags = platform.processor()
    h = hashlib.sha1(flags.encode() + (b"" if ARCH == "native" else ARCH.encode()))
    for source in sources:
        h.update(str(source.resolve()).encode() + source.read_bytes())
    return h.hexdigest()[:12]


@functools.cache
def kernels() -> Any:
    """The compiled operators (a torch.ops namespace: `kernels().paged_attention(...)`), or None (with
    one warning) when they cannot be built."""
    import torch
    from torch.utils.cpp_extension import _get_build_directory, load

    log.info("loading the C++ kernels (compiled on first use: ~30 s once per version and CPU)%s",
             "" if ARCH == "native" else f" for -march={ARCH}")
    name = f"ruvllm_cpu_kernels_{build_tag(SOURCES + HEADERS)}"
    try:
        _use_our_ninja()
        build_dir = Path(_get_build_directory(name, verbose=False))
        with _build_lock(build_dir):
            # The flags name the precompiled header whether or not it is built now (a change in the
            # flags would make ninja rebuild every object), by a path from the build folder, where
            # ninja runs the compiler: a cache moved whole (TORCH_EXTENSIONS_DIR) keeps its flags.
            header = _precompiled_header(build=not (build_dir / f"{name}.so").exists())
            load(name=name, sources=[str(s) for s in SOURCES],
                 extra_cflags=[*CFLAGS, "-include", os.path.relpath(header, build_dir)],
                 extra_ldflags=["-fopenmp", *_shared_libstdcxx()], is_python_module=False, verbose=False)
        ops = getattr(torch.ops, name)
        for op in _FAKES:
            getattr(ops, op)  # registered, or raise here (inside the fallback) rather than at a call
            torch.library.register_fake(f"{name}::{op}", _FAKES[op])
        return ops
    except Exception as e:  # no compiler, no headers, a build error: fall back, say why once
        text = str(e).strip()
        log.warning("C++ kernels unavailable, using the PyTorch paths (%s: %s)", type(e).__name__,
                    text.splitlines()[-1] if text else "")
        return None


def _shared_libstdcxx() -> list[str]:
    """The process's own libstdc++ as a link input, where the compiler would link the static one.

    A compiler that finds no libstdc++.so (the lent H200's image sets CXX=/opt/gcc/bin/g++, a g++ 13.3
    whose -print-file-name=libstdc++.so finds none: session 21, docs/gpu.md) links libstdc++.a into the
    extension: a second copy of the C++ runtime beside the process's libstdc++.so.6, and the first
    number formatted into an error message (a TORCH_CHECK's) crashed the process instead of raising
    (SIGSEGV in that copy's ostream::_M_insert<long>, inside our .so). Named first on the link line,
    the shared library resolves those symbols and no archive member is pulled (nm: _M_insert<long>
    undefined in ours, no codecvt defined; the test then passed there). One compiler call: 4.8 ms here."""
    import subprocess

    try:
        found = subprocess.run([os.environ.get("CXX", "c++"), "-print-file-name=libstdc++.so"],
                               capture_output=True, text=True, timeout=60).stdout.strip()
        maps = Path("/proc/self/maps").read_text()
    except (OSError, subprocess.SubprocessError):
        return []
    if os.path.isabs(found):  # the compiler finds the shared library: it links that one itself
        return []
    loaded = next((line.split()[-1] for line in maps.splitlines() if "/libstdc++.so" in line), None)
    return [loaded] if loaded else []


# What each operator returns, from its inputs' shapes alone: torch.compile and FakeTensorMode trace
# a step through these without running the kernels (csrc/ops.cpp has the schemas).
_FAKES: dict[str, Any] = {
    "paged_attention": lambda q, *_: q.new_empty(q.shape),
    "paged_attention_tiered": lambda q, *_: q.new_empty(q.shape),
    "quantize_kv_blocks": lambda *_: None,
    "dense_matmul": lambda x, w: x.new_empty(x.shape[0], w.shape[0]),
    "quant_matmul": lambda x, codes, *_: x.new_empty(x.shape[0], codes.shape[0]),
    "quant_matmul_grad_input": lambda dy, codes, scales, zeros, group, int4: dy.new_empty(
        dy.shape[0], codes.shape[1] * (2 if int4 else 1)),
    "rms_norm": lambda x, *_: x.new_empty(x.shape),
    "add_rms_norm": lambda x, *_: (x.new_empty(x.shape), x.new_empty(x.shape)),
    "qkv_rope": lambda qkv, cos, sin, hq, hkv, d, *_: (qkv.new_empty(qkv.shape[0], hq, d), qkv.new_empty(qkv.shape[0], hkv, d),
                                                   qkv.new_empty(qkv.shape[0], hkv, d)),
    "silu_and_mul": lambda g: g.new_empty(g.shape[0], g.shape[1] // 2),
    "qkv_rope_cache": lambda qkv, cos, sin, hq, hkv, d, *_: qkv.new_empty(qkv.shape[0], hq, d),
    "llama_layers": lambda x, *_: x.new_empty(x.shape),
    "lora_add": lambda *_: None,
    "apply_token_bitmask": lambda *_: None,
}


def _precompiled_header(build: bool) -> Path:
    """torch_headers.h, copied into a folder of torch's extension cache named for everything the
    precompiled form depends on (_pch_setup), with its .gch beside it when `build` (a build is
    coming) and it is not there yet. gcc takes the .gch for `-include <that copy>` when it was made
    with the same flags, and parses the header itself otherwise (a missing or stale .gch costs time,
    never correctness). ~300 MB, ~14 s of CPU, once per environment: every build of the sources
    (set-up's, each version's, the tests') uses the one .gch."""
    import subprocess

    from torch.utils.cpp_extension import _get_build_directory

    cxx, flags, name = _pch_setup()
    folder = Path(_get_build_directory(name, verbose=False))
    header = folder / PCH_HEADER.name
    if not header.exists():
        (folder / f"{os.getpid()}.h.tmp").write_bytes(PCH_HEADER.read_bytes())
        os.replace(folder / f"{os.getpid()}.h.tmp", header)
    gch = folder / (PCH_HEADER.name + ".gch")
    if build and not gch.exists():
        tmp = folder / f"{os.getpid()}.gch.tmp"
        done = subprocess.run([cxx, "-x", "c++-header", *flags, "-c", str(header), "-o", str(tmp)],
                              capture_output=True, text=True)
        if done.returncode == 0:
            os.replace(tmp, gch)  # whole or absent, even with two builds at once
        else:  # the build goes on without it, and fails with the compiler's own words if it must
            tmp.unlink(missing_ok=True)
            log.info("no precompiled header (%s)", (done.stderr.strip().splitlines() or ["?"])[-1])
    return header


def _pch_setup() -> tuple[str, list[str], str]:
    """The compiler, the flags and the cache folder's name of the precompiled header: torch's own
    flags for a CPU extension (cpp_extension's ninja file) less -DTORCH_EXTENSION_NAME, which every
    build defines differently (gcc refuses a .gch made under another value of a macro, and accepts
    one made without it); the name hashes torch's version, the compiler, the flags, the CPU
    (-march=native) and the header."""
    import torch
    from torch.utils.cpp_extension import include_paths

    cxx = os.environ.get("CXX", "c++")
    flags = ["-DTORCH_API_INCLUDE_EXTENSION_H"]
    python_include = sysconfig.get_path("include", scheme="posix_prefix")
    for folder in [*include_paths("cpu"), *([python_include] if python_include else [])]:
        flags += ["-isystem", folder]
    flags += ["-fPIC", "-std=c++20", *CFLAGS]
    tag = hashlib.sha1(repr((torch.__version__, cxx, flags)).encode() + PCH_HEADER.read_bytes())
    tag.update(build_tag(()).encode())
    return cxx, flags, f"ruvllm_torch_headers_{tag.hexdigest()[:12]}"


def target_isa(cxx: str | None = None) -> list[str]:
    """The vector instruction sets the kernels' #if's see under CFLAGS' -march, as the compiler
    defines them (its preprocessor, ~20 ms): ["avx2", "fma", "f16c", "avx512vnni", ...], or [] for the
    plain C++ paths. What a build runs, named without loading it."""
    import subprocess

    macros = subprocess.run([cxx or os.environ.get("CXX", "c++"), "-x", "c++", *CFLAGS, "-dM", "-E", "-"],
                            input="", capture_output=True, text=True, check=True).stdout
    wanted = ("AVX2", "FMA", "F16C", "AVX512F", "AVX512VL", "AVX512VNNI", "AVXVNNI", "AVX512BF16", "AMX_TILE")
    return [name.lower() for name in wanted if f"#define __{name}__ 1" in macros]


def _use_our_ninja() -> None:
    """torch runs the first `ninja` on PATH, and two ninja versions rebuild everything in turn (each
    discards the other's build log): with a system ninja 1.11 beside our dependency's 1.13, set-up
    and the server rebuilt all 8 objects whenever their PATHs differed. Ours goes first, always."""
    scripts = sysconfig.get_path("scripts")
    path = os.environ.get("PATH", "")
    if scripts and (Path(scripts) / "ninja").exists() and not path.startswith(scripts + os.pathsep):
        os.environ["PATH"] = scripts + os.pathsep + path


@contextlib.contextmanager
def _build_lock(build_dir: Path) -> Iterator[None]:
    """Held around torch's build and load. torch's lock (build_dir/lock) is a file a killed build
    leaves behind, and every later load waits on it without end. Ours is an flock on lock.owner
    beside it, which holds the owner's pid and which the kernel frees when that process dies: who
    takes it knows a lock file still there is a dead build's, and clears it at once. A start that
    finds a live build waits for it, saying so once (docs/decisions.md), at most BUILD_WAIT_S."""
    lock = build_dir / "lock"
    try:
        import fcntl
    except ImportError:  # no flock (Windows): the age rule alone
        _drop_stale_lock(lock)
        yield
        return
    with open(build_dir / "lock.owner", "a+") as owner:
        waited_since = None
        while True:
            try:
                fcntl.flock(owner, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                owner.seek(0)
                who = f"process {owner.read().strip() or '?'}"
                if waited_since is None:
                    waited_since = time.monotonic()
                    log.warning("the C++ kernels are being built by %s (%s); waiting for it (at most %.0f min)",
                                who, lock.parent, BUILD_WAIT_S / 60)
                elif time.monotonic() - waited_since > BUILD_WAIT_S:
                    raise TimeoutError(f"{who} has held the build of {lock.parent} for over "
                                       f"{BUILD_WAIT_S / 60:.0f} min") from None
                time.sleep(0.2)
        owner.seek(0)
        dead = owner.read().strip() or "?"
        if lock.exists():
            log.warning("removing the build lock %s of a killed build (its process %s is gone)", lock, dead)
            lock.unlink(missing_ok=True)
        owner.truncate(0)
        owner.write(str(os.getpid()))
        owner.flush()
        yield


def _drop_stale_lock(lock: Path, max_age_s: float = 900.0) -> None:
    """torch's build lock is a file a killed build leaves behind, and a later build waits on it
    without end. No build takes 15 minutes: an older lock is a dead build's."""
    try:
        age = time.time() - lock.stat().st_mtime
    except FileNotFoundError:
        return
    if age > max_age_s:
        log.warning("removing a stale build lock %s (%.0f min old: a killed build's)", lock, age / 60)
        lock.unlink(missing_ok=True)


if __name__ == "__main__":
    # `python src/ruvllm/cpu_build.py`: build now. Set-up runs it beside pip's install of the rest
    # (scripts/bootstrap.sh), so neither the first request nor the first test waits for the
    # compiler. Run as a file, it needs torch and nothing else of the package's dependencies.
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    raise SystemExit(0 if kernels() is not None else 1)
