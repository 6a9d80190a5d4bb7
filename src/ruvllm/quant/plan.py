"""Which form each linear weight takes, from the user's QuantConfig and what the file stored."""

from __future__ import annotations

import dataclasses
import logging

import torch

from ruvllm.config import QuantConfig
from ruvllm.quant.llamacpp import Q8_BLOCK, quantize_q4k, quantize_q8
from ruvllm.quant.rtn import check_int4_group, quantize_int4, quantize_int8
from ruvllm.quant.weights import INT4_ROWS_MULTIPLE, QuantizedWeight, concat_rows

log = logging.getLogger(__name__)

Weight = torch.Tensor | QuantizedWeight

# llama.cpp's formats, computed at load from float weights (GGUF blocks dequantized exactly first).
LLAMACPP_METHODS = ("q8", "q4k")


def keeps_16bit(cfg: QuantConfig, name: str) -> bool:
    return any(part in cfg.dense_modules for part in name.split("."))


def quantization_for_device(cfg: QuantConfig, device: torch.device, dtype: torch.dtype | None = None,
                            cpu_kernels: bool = True) -> QuantConfig:
    """On CUDA, "auto" means dense weights: PyTorch's CUDA int4 kernel (tinygemm) is built for few
    rows (measured here: 1.77x dense at batch 1 on Llama-3-8B; it is not tuned for the batches
    serving runs), so packing is opt-in there: int8 and int4 run packed when asked. On a CPU where
    our kernels cannot build (`cpu_kernels` False), "auto" keeps packed codes only for bf16 compute:
    PyTorch's packed kernels take bf16 activations and are 15-25x slower fed fp32."""
    if cfg.method != "auto":
        return cfg
    if device.type == "cuda" or (not cpu_kernels and dtype is not None and dtype != torch.bfloat16):
        return dataclasses.replace(cfg, method="none")
    return cfg


def quantizes_weights(cfg: QuantConfig) -> bool:
    """Whether a loader should hand over its quantized blocks instead of dequantizing them (q8/q4k:
    GGUF blocks are decoded exactly, in float32, then re-quantized)."""
    return cfg.method in ("auto", "int4", "int8", "w8a8", *LLAMACPP_METHODS)


def llamacpp_unfit(shape: tuple[int, int]) -> str | None:
    """Why a weight cannot take q8/q4k, or None. Both run on the int4 kernel with groups of 32 (a
    short last Q4_K super-block is allowed: quant/llamacpp.py), so K must split into 32s and N tile by 16."""
    n, k = shape
    if k % Q8_BLOCK:
        return f"its input size {k} is not a multiple of {Q8_BLOCK}"
    if n % INT4_ROWS_MULTIPLE:
        return f"its {n} output rows are not a multiple of {INT4_ROWS_MULTIPLE}"
    return None


def _llamacpp_form(method: str, shape: tuple[int, int]) -> tuple[str, int]:
    if llamacpp_unfit(shape):
        return ("dense", 0)
    return ("int8", Q8_BLOCK) if method == "q8" else ("int4", Q8_BLOCK)


def planned_form(cfg: QuantConfig, name: str, stored: tuple[str, int] | None, shape: tuple[int, int],
                 dtype: torch.dtype) -> tuple[str, int]:
    """The form a linear weight is kept in, from its shape and stored form alone (no tensor needed):
    the one decision, which the weight plan records and `realize` carries out.

    `stored`: (kind, group_size) of the QuantizedWeight a loader hands over, None for a float tensor.
    Returns ("dense", 0) (dense in `dtype`), ("int8", 0) (per channel), ("int8", 32) (Q8_0) or
    ("int4", group_size), and raises ValueError for an int4 group size that does not divide the input size.
    """
    if cfg.method in LLAMACPP_METHODS:
        return ("dense", 0) if keeps_16bit(cfg, name) else _llamacpp_form(cfg.method, shape)
    if keeps_16bit(cfg, name) or cfg.method not in ("auto", "int8", "int4", "w8a8"):
        return ("dense", 0)
    if cfg.method == "auto":
        return _auto_form(stored, shape)
    if cfg.method in ("int8", "w8a8"):
        return ("int8", 0)
    check_int4_group(shape[1], cfg.group_size, name)
    if shape[0] % INT4_ROWS_MULTIPLE:
        return ("int8", 0)
    return ("int4", cfg.group_size)


def _auto_form(stored: tuple[str, int] | None, shape: tuple[int, int]) -> tuple[str, int]:
    """auto keeps what the file stored (a tied LM head: the embedding table's form, so a GGUF's Q8_0
    table is read as it is, in 8 bits at every batch size). Q8_0 runs on our CPU kernel as stored
    (on CUDA auto is `none`: quantization_for_device); where K or N do not tile it, per channel."""
    if stored == ("int8", Q8_BLOCK) and llamacpp_unfit(shape) is not None:
        return ("int8", 0)
    return ("dense", 0) if stored is None else stored


def fused_stored_form(forms: list[tuple[str, int] | None]) -> tuple[str, int] | None:
    """Stored form of a fused weight (q/k/v, gate/up) from its pieces' forms (None: float).

    Pieces packed alike keep that form. Pieces packed differently (a Q4_K file with a Q8_0 or Q6_K
    attn_v) are fused in float and held as per-channel int8, the packed form that loses least;
    only all-float pieces stay float."""
    if all(f is not None for f in forms) and len(set(forms)) == 1:
        return forms[0]
    return ("int8", 0) if any(f is not None for f in forms) else None


def fuse_pieces(pieces: list[Weight]) -> Weight:
    """The fused weight whose stored form is fused_stored_form of the pieces'."""
    if len(pieces) == 1:
        return pieces[0]
    forms = [(p.kind, p.group_size) if isinstance(p, QuantizedWeight) else None for p in pieces]
    stored = fused_stored_form(forms)
    if stored is not None and stored == forms[0] and None not in forms:
        return concat_rows(pieces)  # type: ignore[arg-type]
    dense = torch.cat([p.dequantize() if isinstance(p, QuantizedWeight) else p.float() for p in pieces])
    return dense if stored is None else quantize_int8(dense)


def stored_form(weight: Weight) -> tuple[str, int] | None:
    """(kind, group_size) of a packed weight; None for a float tensor."""
    return (weight.kind, weight.group_size) if isinstance(weight, QuantizedWeight) else None


def final_form(cfg: QuantConfig, name: str, weight: Weight, dtype: torch.dtype) -> Weight:
    """`weight` realized in the form planned_form chooses for it (the loader does the same through
    its WeightPlan)."""
    return realize(cfg, name, weight, planned_form(cfg, name, stored_form(weight), tuple(weight.shape), dtype), dtype)


def realize(cfg: QuantConfig, name: str, weight: Weight, form: tuple[str, int], dtype: torch.dtype) -> Weight:
    """`weight` made into `form`, which planned_form chose for it (directly or through a WeightPlan)."""
    stored = stored_form(weight)
    kind, group = form
    if cfg.method in LLAMACPP_METHODS:
        return _llamacpp_final(cfg, name, weight, stored, kind, dtype)
    if kind == "dense":
        return _dense(weight, dtype)
    if kind == "int8":
        if stored == form:
            return weight
        if cfg.method == "int4":
            log.warning("%s: %d output rows are not a multiple of %d; kept as int8 instead of int4",
                        name, weight.shape[0], INT4_ROWS_MULTIPLE)
        dense = _dense(weight, torch.float32)
        # Per channel: group-wise int8 that no Q8_0 form was planned for is re-quantized.
        return quantize_q8(dense) if group else quantize_int8(dense)
    if stored == ("int4", group):  # a file's own 4-bit codes, kept when their groups are the ones asked for
        return weight
    return quantize_int4(_dense(weight, torch.float32), group, name)


def _llamacpp_final(cfg: QuantConfig, name: str, weight: Weight, stored: tuple[str, int] | None, kind: str,
                    dtype: torch.dtype) -> Weight:
    method = cfg.method
    if kind == "dense":
        if not keeps_16bit(cfg, name):
            log.warning("%s: %s; kept dense (%s) instead of %s", name, llamacpp_unfit(tuple(weight.shape)),
                        str(dtype).removeprefix("torch."), method)
        return _dense(weight, dtype)
    if method == "q8" and stored == ("int8", Q8_BLOCK):  # a GGUF Q8_0 weight is q8 already
        return weight
    dense = _dense(weight, torch.float32)
    return quantize_q8(dense) if method == "q8" else quantize_q4k(dense)


def _dense(weight: Weight, dtype: torch.dtype) -> torch.Tensor:
    if isinstance(weight, QuantizedWeight):
        return weight.dequantize().to(dtype)
    return weight.to(dtype)
