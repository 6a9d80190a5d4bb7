"""Which form each linear weight takes, from the user's QuantConfig and what the file stored."""

from __future__ import annotations

import logging

import torch

from ruvllm.config import QuantConfig
from ruvllm.quant.rtn import check_int4_group, quantize_int4, quantize_int8
from ruvllm.quant.weights import INT4_ROWS_MULTIPLE, QuantizedWeight

log = logging.getLogger(__name__)

Weight = torch.Tensor | QuantizedWeight


def keeps_16bit(cfg: QuantConfig, name: str) -> bool:
    return any(part in cfg.keep_16bit for part in name.split("."))


def quantizes_weights(cfg: QuantConfig, dtype: torch.dtype) -> bool:
    """Whether a loader should hand over its quantized blocks instead of dequantizing them."""
    return cfg.method in ("int4", "int8") or (cfg.method == "auto" and dtype == torch.bfloat16)


def final_form(cfg: QuantConfig, name: str, weight: Weight, dtype: torch.dtype) -> Weight:
    """The form a linear layer's (fused) weight is kept in: a dense tensor or a QuantizedWeight."""
    as_stored = cfg.method == "auto" and dtype == torch.bfloat16  # the packed kernels compute in bf16
    if keeps_16bit(cfg, name) or not (as_stored or cfg.method in ("int8", "int4")):
        return _dense(weight, dtype)
    if as_stored and not isinstance(weight, QuantizedWeight):
        return weight.to(dtype)
    if cfg.method == "int8" or (as_stored and weight.kind == "int8"):
        if isinstance(weight, QuantizedWeight) and weight.kind == "int8" and weight.group_size == 0:
            return weight
        # Group-wise int8 (GGUF Q8_0) is re-quantized per channel: the packed kernel takes no groups.
        return quantize_int8(_dense(weight, torch.float32))
    if as_stored:
        return weight
    check_int4_group(weight.shape[1], cfg.group_size, name)
    if weight.shape[0] % INT4_ROWS_MULTIPLE:
        # The packed int4 layout needs whole tiles of rows; such a layer stays int8 rather than fail.
        log.warning("%s: %d output rows are not a multiple of %d; kept as int8 instead of int4",
                    name, weight.shape[0], INT4_ROWS_MULTIPLE)
        return quantize_int8(_dense(weight, torch.float32))
    # int4: a file's own 4-bit codes are kept when their groups are the ones asked for.
    if isinstance(weight, QuantizedWeight) and weight.kind == "int4" and weight.group_size == cfg.group_size:
        return weight
    return quantize_int4(_dense(weight, torch.float32), cfg.group_size, name)


def _dense(weight: Weight, dtype: torch.dtype) -> torch.Tensor:
    if isinstance(weight, QuantizedWeight):
        return weight.dequantize().to(dtype)
    return weight.to(dtype)
