"""Names of the engine's precisions, and the "auto" choice for this machine."""

from __future__ import annotations

import functools
from pathlib import Path

import torch

from ruvllm.config import QuantConfig

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16}


@functools.cache
def cpu_has_native_bf16() -> bool:
    """AVX-512 BF16 or AMX: bf16 matmuls run at native speed (elsewhere they are emulated, and slow)."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
        if "avx512_bf16" in flags or "amx_bf16" in flags:
            return True
    except OSError:
        pass
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def resolve_dtype(name: str, device: str = "cpu") -> torch.dtype:
    """"auto": bf16 where the hardware computes it natively (CUDA, CPUs with AVX-512 BF16 / AMX), else fp32."""
    if name == "auto":
        if device.startswith("cuda") or cpu_has_native_bf16():
            return torch.bfloat16
        return torch.float32
    if name not in DTYPES:
        raise ValueError(f"dtype must be 'auto' or one of {sorted(DTYPES)}, got {name!r}")
    return DTYPES[name]


def resolve_model_dtype(name: str, quantization: QuantConfig, device: str = "cpu") -> torch.dtype:
    """The model's compute dtype. Dense 16-bit quantization names one; "auto" follows it, and an
    explicit dtype that contradicts it is an error rather than a silent choice."""
    dense = {"bf16": torch.bfloat16, "f16": torch.float16}.get(quantization.method)
    if dense is None:
        return resolve_dtype(name, device)
    if name != "auto" and resolve_dtype(name, device) != dense:
        raise ValueError(f"dtype {name!r} contradicts quantization {quantization.method!r} "
                         "(dense 16-bit weights compute in their own dtype); drop one of them")
    return dense
