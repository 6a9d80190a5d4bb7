"""--device and what it implies: resolution, clear errors, quantization per device, bucket sizes."""

from __future__ import annotations

import os

import pytest
import torch

from ruvllm.config import QuantConfig
from ruvllm.device import default_num_threads, resolve_device
from ruvllm.quant.plan import quantization_for_device
from ruvllm.worker.cuda_graphs import bucket_sizes


def test_auto_and_cpu() -> None:
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")


@pytest.mark.parametrize("name", ["gpu", "cuda:x", "tpu", ""])
def test_unknown_names_are_refused(name: str) -> None:
    with pytest.raises(ValueError, match="auto, cpu, cuda or cuda:N"):
        resolve_device(name)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
def test_cuda_without_a_gpu_says_so() -> None:
    with pytest.raises(ValueError, match="sees no CUDA GPU"):
        resolve_device("cuda")


def test_quantization_per_device() -> None:
    cuda = torch.device("cuda")
    assert quantization_for_device(QuantConfig("auto"), torch.device("cpu")).method == "auto"
    assert quantization_for_device(QuantConfig("auto"), cuda).method == "none"
    assert quantization_for_device(QuantConfig("bf16"), cuda).method == "bf16"
    assert quantization_for_device(QuantConfig("int4", 64), cuda) == QuantConfig("int4", 64)
    # Without our CPU kernels (no compiler) auto keeps packed codes only for bf16 compute.
    cpu = torch.device("cpu")
    assert quantization_for_device(QuantConfig("auto"), cpu, torch.float32, cpu_kernels=False).method == "none"
    assert quantization_for_device(QuantConfig("auto"), cpu, torch.bfloat16, cpu_kernels=False).method == "auto"
    assert quantization_for_device(QuantConfig("auto"), cpu, torch.float32, cpu_kernels=True).method == "auto"
    assert quantization_for_device(QuantConfig("int4"), cpu, torch.float32, cpu_kernels=False).method == "int4"


def test_auto_without_our_kernels_is_dense_in_fp32(monkeypatch: pytest.MonkeyPatch) -> None:
    """The weight plan, which the loader follows, asks whether our kernels build: without them an
    fp32 engine gets dense weights (PyTorch's packed kernels need bf16 activations)."""
    from ruvllm import cpu_build
    from ruvllm.models.weight_plan import weight_plan

    if cpu_build.kernels() is not None:
        assert weight_plan(None, QuantConfig(), "float32").quant.method == "auto"
    monkeypatch.setattr(cpu_build, "kernels", lambda: None)
    plan = weight_plan(None, QuantConfig(), "float32")
    assert plan.quant.method == "none" and plan.linear_forms() == {"dense float32": 120}
    packed = weight_plan(None, QuantConfig(), "bfloat16")  # a Q8_0 head off our kernel: int4 over 2K
    assert packed.weights["lm_head.weight"].nbytes == 49152 * 2 * 576 // 2 + 4 * 49152 * 2 * 576 // 32


def test_graph_buckets_cover_every_batch_size() -> None:
    assert bucket_sizes(1) == [1]
    assert bucket_sizes(32) == [1, 2, 4, 8, 16, 24, 32]
    sizes = bucket_sizes(256)
    assert sizes[:8] == [1, 2, 4, 8, 16, 24, 32, 40] and sizes[-3:] == [224, 240, 256]
    assert bucket_sizes(100)[-2:] == [96, 100]


def test_cli_bad_device_is_one_line_error(monkeypatch: pytest.MonkeyPatch) -> None:
    from tests.unit.test_cli_models import assert_one_line_error, invoke

    monkeypatch.setenv("COLUMNS", "1000")
    assert_one_line_error(invoke("benchmark", "--device", "tpu", "--iterations", "1"), "cuda:N", "'tpu'")


def test_default_threads_honour_omp_num_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert default_num_threads() == 3
    # Unset or unusable: the CPUs this process may run on.
    for value in (None, "", "0", "many"):
        if value is None:
            monkeypatch.delenv("OMP_NUM_THREADS")
        else:
            monkeypatch.setenv("OMP_NUM_THREADS", value)
        assert default_num_threads() == len(os.sched_getaffinity(0))
