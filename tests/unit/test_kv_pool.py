"""The KV pool's memory (model_runner.zeroed_pool): zeros, as torch.zeros gave, but its pages taken
from the kernel when first touched, not all written at start-up; freed with the tensor."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ruvllm.worker.model_runner import zeroed_pool

STATUS = Path("/proc/self/status")


def _kib(field: str) -> int:
    line = next(line for line in STATUS.read_text().splitlines() if line.startswith(field + ":"))
    return int(line.split()[1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.uint8])
def test_the_pool_is_zeros_of_its_shape(dtype: torch.dtype) -> None:
    pool = zeroed_pool((2, 2, 48, 3, 64), dtype, torch.device("cpu"))
    assert pool.shape == (2, 2, 48, 3, 64) and pool.dtype == dtype and pool.is_contiguous()
    assert not pool.any()
    pool[1, 0, 5] = 1  # writable, and a view of it writes through
    assert pool[1, 0].sum() == 3 * 64
    assert zeroed_pool((0, 3), dtype, torch.device("cpu")).shape == (0, 3)


@pytest.mark.skipif(not STATUS.exists(), reason="reads the process's memory from /proc")
def test_its_pages_are_resident_only_once_touched_and_unmapped_with_it() -> None:
    size, before = 512 * 2**20, _kib("VmRSS")
    vm = _kib("VmSize")
    pool = zeroed_pool((size // 4,), torch.float32, torch.device("cpu"))
    assert _kib("VmSize") - vm >= size // 1024  # mapped...
    assert _kib("VmRSS") - before < 64 * 1024  # ...but not resident: torch.zeros wrote all 512 MiB
    pool[: 16 * 2**20 // 4] = 1.0
    assert _kib("VmRSS") - before >= 16 * 1024  # the touched 16 MiB are
    del pool
    assert _kib("VmSize") - vm < 64 * 1024  # unmapped with the tensor
