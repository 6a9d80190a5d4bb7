"""One of our C++ kernel sources, as it is at a git revision or in a file, built alone as its own
extension: for benchmarks that time a kernel against its earlier self in one process, round after
round, and check that both give the same bits (quant_matmul_rows.py, dense_matmul.py); and how they
time one call."""

from __future__ import annotations

import argparse
import hashlib
import os
import re
import subprocess
import time
from pathlib import Path
from typing import Callable

import torch

ROOT = Path(__file__).resolve().parents[1]


def source_at(rev: str | None, path: Path) -> str:
    """The source file `path` (relative to the repository) at git revision `rev` (None: as it is in
    the tree), with its local includes (`#include "..."`) inlined as they are there: built alone, it
    is away from the files it includes."""
    def read(p: Path) -> str:
        if rev is None:
            return (ROOT / p).read_text()
        return subprocess.run(["git", "show", f"{rev}:{p.as_posix()}"], cwd=ROOT, check=True, capture_output=True,
                              text=True).stdout

    return re.sub(r'^#include "([^"]+)"$', lambda m: read(Path(os.path.normpath(path.parent / m.group(1)))),
                  read(path), flags=re.M)


def standalone(text: str, op: str, declaration: str, schema: str) -> Callable[..., torch.Tensor]:
    """`text` (one kernel source) built alone with one operator registered under a name of its own:
    `declaration` is the C++ declaration of ruvllm::`op`, `schema` its operator schema."""
    from torch.utils.cpp_extension import load

    from ruvllm.cpu_build import CFLAGS

    tag = hashlib.sha1((text + declaration + schema).encode()).hexdigest()[:10]
    folder = Path.home() / ".cache" / "ruvllm" / "bench-kernels" / tag
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{op}.cpp").write_text(text)
    (folder / "register.cpp").write_text(
        "#include <torch/library.h>\n#include <optional>\n"
        f"namespace ruvllm {{ {declaration}; }}\n"
        f'TORCH_LIBRARY(TORCH_EXTENSION_NAME, m) {{ m.def("{schema}"); }}\n'
        f'TORCH_LIBRARY_IMPL(TORCH_EXTENSION_NAME, CPU, m) {{ m.impl("{op}", &ruvllm::{op}); }}\n')
    name = f"ruvllm_bench_{op}_{tag}"
    load(name=name, sources=[str(folder / f"{op}.cpp"), str(folder / "register.cpp")],
         extra_cflags=CFLAGS, extra_ldflags=["-fopenmp"], is_python_module=False, verbose=False)
    return getattr(getattr(torch.ops, name), op)


def best_of(fn: Callable[[], object], budget_s: float, clock: Callable[[], float] = time.perf_counter) -> float:
    """The best time of a few calls of `fn` (at least 2, more while under `budget_s`, at most 50), seconds."""
    best, spent, calls = float("inf"), 0.0, 0
    while calls < 2 or (spent < budget_s and calls < 50):
        t0 = clock()
        fn()
        dt = clock() - t0
        best, spent, calls = min(best, dt), spent + dt, calls + 1
    return best


def add_arguments(p: argparse.ArgumentParser, threads: int = 1, budget: float = 0.2) -> None:
    """The options every kernel benchmark here takes: rounds, threads, the time budget of a cell, and
    the revision to compare with."""
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=threads)
    p.add_argument("--budget", type=float, default=budget, help="seconds of calls per cell, kernel and round")
    p.add_argument("--compare-with", metavar="REV", help="also time the kernel's source at this git revision")
