"""SmoothQuant scales for W8A8: measured on calibration text, folded into the float model (then written
as a dense folder by awq_writer.write_float_folder and quantized at load time by `-q w8a8`).

W8A8 quantizes each activation row with one scale, its absmax / 127. A few input channels carry
activations far larger than the rest, so they set every row's scale and the other channels keep
only a few levels. SmoothQuant (Xiao et al. 2023) divides input channel j by s_j and multiplies
weight column j by s_j: the float product is unchanged, the activation rows get flatter, and the
weights (one int8 scale per output row, far less sensitive to a column's size) take the outliers.
    s_j = max|X_j| ** alpha / max|W_j| ** (1 - alpha)
max|X_j| over the calibration tokens, max|W_j| over all output rows of the linears sharing the input.
alpha moves the difficulty: 0 leaves it in the activations, 1 moves it all into the weights.

The division of X is folded into whatever produces X, exactly (awq.fold_scales, AWQ's folds):
  q/k/v     <- input_layernorm weight
  gate/up   <- the MLP's input norm weight (the layer's MLP_NORM)
  o_proj    <- v rows of qkv_proj: the attention output is a convex mix of v rows per head, so
               scaling v channel c scales channel c of every query head reading that kv head.
               Those o_proj inputs therefore share one scale (max over the tied channels).
  down_proj <- up rows of gate_up_proj: silu(gate) * up is linear in up.
Scaling v and up rows costs their own W8A8 nothing: weights are quantized per output row, so a row
times a constant has the same codes. All four groups are smoothed by default because each helps on
the default model: at alpha 0.6, perplexity under W8A8 rises when o_proj, down_proj or both are
left out (docs/quantization.md). The LM head (16-bit under w8a8) and the final norm are left
alone; the embeddings would have to change with a tied head.

The statistics come from awq.calibrate (the same calibration forward and recorders as AWQ), layer
by layer on the float model in float32. Each group's W8A8 output error on the recorded rows, with
and without its scales, is returned for the report; nothing is searched.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ruvllm.quantize.awq import FOLD_ORDER, calibrate, fold_scales, o_proj_tie
from ruvllm.quant.linear import quantize_rows_int8
from ruvllm.quant.rtn import quantize_int8

# Measured on the default model (docs/quantization.md): W8A8 perplexity is lowest at 0.6 of
# 0.3, 0.4, 0.5, 0.55, 0.6, 0.65, 0.7, 0.8; the migration-strength 0.5 of the paper is +0.5% worse.
DEFAULT_ALPHA = 0.6


@dataclass(frozen=True)
class SmoothResult:
    """One group of one layer: the W8A8 output MSE on the recorded inputs with the smoothing scales
    (error) and without (plain_error)."""

    layer: int
    group: str  # "o_proj", "qkv_proj", "down_proj", "gate_up_proj"
    error: float
    plain_error: float


def check_alpha(alpha: float) -> None:
    if not 0.0 < alpha < 1.0:
        raise ValueError(f"--alpha must be between 0 and 1 (exclusive), got {alpha:g}")


def smooth_scales(act_absmax: torch.Tensor, weight: torch.Tensor, alpha: float,
                  tie: tuple[int, int, int] | None = None) -> torch.Tensor:
    """s [K] for weight [N, K] whose inputs reached act_absmax [K]: max|X_j|^alpha / max|W_j|^(1-alpha).
    tie: (kv heads, heads per kv head, head_dim) when the inputs are query-head channels that must
    share one scale per kv channel (o_proj; see awq.o_proj_tie). A channel that never saw an
    activation, or whose weights are all zero, keeps s = 1: there is nothing to balance."""
    a = act_absmax.float()
    w = weight.float().abs().amax(dim=0)
    if tie is not None:
        a, w = (t.view(tie).amax(dim=1).reshape(-1) for t in (a, w))
    s = a.pow(alpha) / w.pow(1.0 - alpha)
    s = torch.where((a > 0) & (w > 0), s, torch.ones_like(s))
    if tie is not None:
        s = s.view(tie[0], 1, tie[2]).expand(tie).reshape(-1)
    return s


def w8a8_mse(x: torch.Tensor, weight: torch.Tensor) -> float:
    """Mean squared error of x [T, K] @ weight [N, K].T computed as `-q w8a8` computes it (rows of x
    and of the weight each to int8 with their own scale) against the float product."""
    xq, sx = quantize_rows_int8(x)
    qw = quantize_int8(weight)
    y = (xq.double() @ qw.codes.double().t()) * sx.double() * qw.scales.double()
    return (y - x.double() @ weight.double().t()).pow(2).mean().item()


@torch.no_grad()
def smooth_fold(model: torch.nn.Module, ids: torch.Tensor, alpha: float = DEFAULT_ALPHA,
                groups: tuple[str, ...] = FOLD_ORDER,
                on_layer: Callable[[int], None] | None = None) -> list[SmoothResult]:
    """Fold SmoothQuant scales into `model` (ruvllm's float32 LlamaForCausalLM, dense weights) in
    place, layer by layer over calibration ids [S, L], for the linear `groups` (names of
    awq.FOLD_ORDER). The float model computes what it did before. Returns each group's result."""
    check_alpha(alpha)
    unknown = set(groups) - set(FOLD_ORDER)
    if unknown:
        raise ValueError(f"unknown groups {sorted(unknown)}; choose from {', '.join(FOLD_ORDER)}")
    tie = o_proj_tie(model.cfg)
    results: list[SmoothResult] = []
    for index, layer, rec in calibrate(model, ids):
        for group in (g for g in FOLD_ORDER if g in groups):
            weight = getattr(layer, group).weight.data
            scales = smooth_scales(rec[group].absmax, weight, alpha, tie if group == "o_proj" else None)
            x = rec[group].inputs
            plain = w8a8_mse(x, weight)
            fold_scales(layer, group, scales)
            results.append(SmoothResult(index, group, w8a8_mse(x / scales, weight), plain))
        if on_layer is not None:
            on_layer(index)
    return results
