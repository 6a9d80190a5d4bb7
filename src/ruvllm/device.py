"""Which device the engine runs on: "auto" is CUDA when PyTorch sees a GPU, else the CPU."""

from __future__ import annotations

import os
import re
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


def check_device_name(name: str) -> None:
    """The spelling alone, without importing torch (a front that starts the core elsewhere checks
    this first; whether the device exists is for the process that runs the model)."""
    if name not in ("auto", "cpu") and not re.fullmatch(r"cuda(:\d+)?", name):
        raise ValueError(f"device must be auto, cpu, cuda or cuda:N, got {name!r}")


def resolve_device(name: str) -> torch.device:
    import torch

    check_device_name(name)
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ValueError(f"device {name!r} asked for, but this PyTorch sees no CUDA GPU "
                         f"(torch {torch.__version__}, CUDA build: {torch.version.cuda is not None})")
    dev = torch.device(name)
    index = dev.index or 0
    if index >= torch.cuda.device_count():
        raise ValueError(f"device {name!r}: only {torch.cuda.device_count()} CUDA device(s) present")
    return torch.device("cuda", index)


def default_num_threads() -> int:
    """CPU threads when none are asked for: OMP_NUM_THREADS where it is set (every OpenMP program
    honours it, and a parent running several engines side by side sets it to share the cores), else
    the CPUs this process may run on (its affinity: a container or taskset may allow fewer than
    the machine has)."""
    env = os.environ.get("OMP_NUM_THREADS", "").strip()
    if env.isdigit() and int(env) > 0:
        return int(env)
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1
