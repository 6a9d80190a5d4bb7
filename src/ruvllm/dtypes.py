"""Names of the engine's precisions, and the "auto" choice for this machine."""

from __future__ import annotations


import torch

from ruvllm.config import QuantConfig

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16}


def resolve_dtype(name: str, device: str = "cpu") -> torch.dtype:
    """"auto": bf16 on CUDA, fp32 on the CPU. Our CPU kernels (the layer loop, the packed-weight
    matmuls, LoRA) compute in fp32; even on a CPU with native bf16 (AVX-512 BF16) fp32 measured
    1.25x faster a decode step and a 256-token prefill (docs/decisions.md)."""
    if name == "auto":
        return torch.bfloat16 if device.startswith("cuda") else torch.float32
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
