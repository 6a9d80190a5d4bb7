"""llama.cpp's Q8_0 and Q4_K quantizers, applied to float weights at load (`-q q8`, `-q q4k`).

Each one writes genuine GGUF block bytes, as llama.cpp's reference quantizers (the ones
`llama-quantize` uses without an importance matrix) compute them, and reads them back through
gguf_blocks, the reader that keeps a GGUF file's own Q8_0 / Q4_K weights packed. So the weights
computed with are, by construction, what those blocks decode to, in the forms the existing
kernels run (docs/quantization.md).

Q8_0, per block of 32 inputs: d = max|w| / 127, q = round(w / d) (half away from zero), d stored
as fp16. As in llama.cpp the codes are chosen against the float32 d, before it is rounded to fp16.

Q4_K, per super-block of 256 inputs (8 sub-blocks of 32): each sub-block gets an asymmetric
grid w ~ scale * q - min, q in 0..15, from llama.cpp's weighted search (make_qkx2_quants with
Q4_K's settings: weights sqrt(mean w^2) + |w|, the min-max grid and then 21 steps range / (14 + 0.1 i),
each rounded, refitted by weighted least squares and kept if its weighted error is lower); the 8
scales and 8 mins are then quantized to 6 bits against the super-block's fp16 d = max(scale) / 63
and dmin = max(min) / 63, and the codes chosen again against the grid actually stored.
"""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGMLQuantizationType as QType

from ruvllm.cpu_build import kernels
from ruvllm.quant.gguf_blocks import gguf_int4, gguf_int8
from ruvllm.quant.weights import QuantizedWeight

Q8_BLOCK = 32  # inputs per Q8_0 block
Q4K_SUB = 32  # inputs per Q4_K sub-block (one scale and min)
Q4K_SUPER = 256  # inputs per Q4_K super-block (one fp16 d and dmin)
Q4K_BYTES = 144  # d, dmin (fp16 each), 12 bytes of 6-bit scales and mins, 128 bytes of nibbles
_SUBS = Q4K_SUPER // Q4K_SUB

# make_qkx2_quants' settings for Q4_K: candidate inverse steps (15 + rmin + rdelta * i) / range.
_NMAX, _RMIN, _RDELTA, _NSTEP = 15, -1.0, 0.1, 20
# Sub-blocks searched at once: [32, B] temporaries of 1 MiB, and the per-sub-block steps stay
# under ATen's grain size (32768), so they run on one thread instead of waking the pool.
_CHUNK = 1 << 13


# ---------------------------------------------------------------------------------------------
# Q8_0


def _round_half_away(t: torch.Tensor) -> torch.Tensor:
    """C's roundf. floor(|t| + 0.5) would round 0.49999997 up (the sum rounds to 1.0 in float32)."""
    a = t.abs()
    whole = a.floor()
    return torch.copysign(whole + (a - whole >= 0.5).float(), t)


def _check_blocks(k: int, block: int) -> None:
    if k % block:
        raise ValueError(f"input size {k} is not a multiple of {block}")


def q8_0_blocks(w: torch.Tensor) -> np.ndarray:
    """[N, K] float weights (K a multiple of 32) -> Q8_0 bytes, [N, K / 32 * 34] uint8."""
    n, k = w.shape
    _check_blocks(k, Q8_BLOCK)
    x = w.detach().float().cpu().reshape(-1, Q8_BLOCK)
    d = x.abs().amax(dim=1, keepdim=True) / 127.0
    inv = torch.where(d == 0, torch.zeros_like(d), 1.0 / d)
    codes = _round_half_away(x * inv).to(torch.int8)
    raw = torch.cat([d.to(torch.float16).view(torch.uint8), codes.view(torch.uint8)], dim=1)
    return raw.reshape(n, k // Q8_BLOCK * 34).numpy()


def quantize_q8(w: torch.Tensor) -> QuantizedWeight:
    """Q8_0 as group-wise int8 (groups of 32, the fp16 block scales), exactly as gguf_int8 reads it."""
    return gguf_int8(q8_0_blocks(w), tuple(w.shape))


# ---------------------------------------------------------------------------------------------
# Q4_K


def _candidate_numerators() -> list[torch.Tensor]:
    """15 + rmin + rdelta * i, rounded to float32 one operation at a time as the C code computes it."""
    f32 = torch.float32
    return [(torch.tensor(_RMIN, dtype=f32) + torch.tensor(_RDELTA, dtype=f32) * i) + _NMAX
            for i in range(_NSTEP + 1)]


_NUMERATORS = _candidate_numerators()
_NUMERATOR_TENSOR = torch.stack(_NUMERATORS)


def _sum_in_order(terms: torch.Tensor) -> torch.Tensor:
    """Sum [..., 32, B] over the 32 one term after another in float32, as C's loops do (torch's own
    reductions add in another order, and its cumsum in double)."""
    acc = terms[..., 0, :].clone()
    for i in range(1, terms.shape[-2]):
        acc += terms[..., i, :]
    return acc


class _Scratch:
    """[32, B] buffers reused by every candidate (each needs a dozen full-size temporaries)."""

    def __init__(self, xt: torch.Tensor) -> None:
        self.codes = torch.empty_like(xt)
        self.diff = torch.empty_like(xt)
        self.terms = torch.empty((3, *xt.shape), dtype=xt.dtype)

    def grid(self, xt: torch.Tensor, inv: torch.Tensor, low: torch.Tensor) -> torch.Tensor:
        """nearest_int(inv * (x - low)), clamped to 0..15."""
        return torch.sub(xt, low, out=self.codes).mul_(inv).round_().clamp_(0, _NMAX)

    def error(self, xt: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, low: torch.Tensor,
              codes: torch.Tensor) -> torch.Tensor:
        """sum_i w_i (scale * q_i + low - x_i)^2."""
        diff = torch.mul(codes, scale, out=self.diff).add_(low).sub_(xt)
        return _sum_in_order(diff.mul_(diff).mul_(w))

    def sums(self, xt: torch.Tensor, w: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
        """[3, B]: sum w q, sum w q q, sum w q x, with w q rounded first (C multiplies left to right)."""
        wl = torch.mul(w, codes, out=self.terms[0])
        torch.mul(wl, codes, out=self.terms[1])
        torch.mul(wl, xt, out=self.terms[2])
        return _sum_in_order(self.terms)


def _search_chunk(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """make_qkx2_quants(32, 15, x, weights, ..., -1, 0.1, 20, use_mad=false) on rows of x [B, 32].

    Returns (scale, min, codes): the sub-block's grid is scale * q - min, min >= 0. The codes are
    only used for sub-blocks whose 6-bit scale comes out 0, where llama.cpp keeps them too.

    Every float32 operation is the one the C code does, in its order: elementwise steps run on all
    sub-blocks at once (as [32, B], one input position per row), and sums add the 32 terms in turn.
    The candidates are tried in turn because each one's grid is laid from the best min found so far.
    """
    xt = x.t().contiguous()  # [32, B]
    # torch's float32 sqrt is not always correctly rounded (C's sqrtf is); via float64 it is
    w = torch.sqrt((_sum_in_order(xt * xt) / 32.0).double()).float() + xt.abs()
    low = first_low = xt.amin(dim=0).clamp(max=0.0)
    top = xt.amax(dim=0)
    flat = top == low
    top = torch.where(flat, low + 1.0, top)  # flat sub-blocks are patched at the end
    sum_w, sum_x = _sum_in_order(w), _sum_in_order(w * xt)
    work = _Scratch(xt)

    inv = _NMAX / (top - low)
    scale = 1.0 / inv
    best = work.error(xt, w, scale, low, work.grid(xt, inv, low))
    kept_inv, kept_low = inv, low  # the best grid's codes are laid again from these at the end
    for num in _NUMERATORS:
        inv = num / (top - low)
        cand = work.grid(xt, inv, low)
        sl, sl2, sxl = work.sums(xt, w, cand)
        det = sum_w * sl2 - sl * sl
        fit_scale = (sum_w * sxl - sum_x * sl) / det
        fit_low = (sl2 * sum_x - sl * sxl) / det
        # A grid whose low end comes out above zero is refitted through zero (scale only).
        above = fit_low > 0
        fit_low = torch.where(above, torch.zeros_like(fit_low), fit_low)
        fit_scale = torch.where(above, sxl / sl2, fit_scale)
        err = work.error(xt, w, fit_scale, fit_low, cand)
        better = (det > 0) & (err < best)
        best = torch.where(better, err, best)
        kept_inv, kept_low = torch.where(better, inv, kept_inv), torch.where(better, low, kept_low)
        scale, low = torch.where(better, fit_scale, scale), torch.where(better, fit_low, low)
    codes = work.grid(xt, kept_inv, kept_low)
    scale = torch.where(flat, torch.zeros_like(scale), scale)
    low = torch.where(flat, first_low, low)
    codes = torch.where(flat, torch.zeros_like(codes), codes)
    return scale, -low, codes.t()


def _sub_block_grids(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each sub-block's (scale, min, codes) for x [S, 32]: our C++ kernel where it is built (the same
    bits; quant/csrc/q4k_search.cpp says why it exists: 33 s of CPU here for the default model),
    else the PyTorch statement above, a chunk of sub-blocks at a time."""
    ext = kernels()
    if ext is not None:
        return ext.q4k_sub_block_grids(x.contiguous(), _NUMERATOR_TENSOR)
    parts = [_search_chunk(x[i:i + _CHUNK]) for i in range(0, x.shape[0], _CHUNK)]
    return tuple(torch.cat([p[j] for p in parts]) for j in range(3))  # type: ignore[return-value]


def _six_bit(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[S, 8] non-negative sub-block scales (or mins) -> (6-bit levels [S, 8], fp16 step [S])."""
    top = values.amax(dim=1)
    positive = top > 0
    # C keeps the running max from +0 with a strict >: a sub-block min of -0 must not make dmin -0
    top = torch.where(positive, top, torch.zeros_like(top))
    inv = torch.where(positive, 63.0 / torch.where(positive, top, torch.ones_like(top)), torch.zeros_like(top))
    levels = (inv[:, None] * values).round().clamp(0, 63)
    return levels, (top / 63.0).to(torch.float16)


def _pack_scales(ls: torch.Tensor, lm: torch.Tensor) -> torch.Tensor:
    """Q4_K's 12-byte scale field: sub-blocks 0-3 in the low 6 bits of bytes 0-3 (scales) and 4-7
    (mins); sub-blocks 4-7 as low nibbles in bytes 8-11 and their top 2 bits in bits 6-7 of 0-7."""
    ls, lm = ls.to(torch.int32), lm.to(torch.int32)
    head = torch.cat([ls[:, :4] | ((ls[:, 4:] >> 4) << 6), lm[:, :4] | ((lm[:, 4:] >> 4) << 6)], dim=1)
    tail = (ls[:, 4:] & 0xF) | ((lm[:, 4:] & 0xF) << 4)
    return torch.cat([head, tail], dim=1).to(torch.uint8)


def _pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """[S, 256] codes -> [S, 128] bytes: each 64-weight run as 32 bytes, its first half in the low nibbles."""
    runs = codes.to(torch.uint8).reshape(-1, 4, 2, 32)
    return (runs[:, :, 0] | (runs[:, :, 1] << 4)).reshape(-1, 128)


def q4_k_blocks(w: torch.Tensor) -> np.ndarray:
    """[N, K] float weights (K a multiple of 256) -> Q4_K bytes, [N, K / 256 * 144] uint8."""
    n, k = w.shape
    _check_blocks(k, Q4K_SUPER)
    x = w.detach().float().cpu().reshape(-1, Q4K_SUB)
    scale, low, search_codes = _sub_block_grids(x)
    ls, d = _six_bit(scale.reshape(-1, _SUBS))
    lm, dmin = _six_bit(low.reshape(-1, _SUBS))
    step = (d.float()[:, None] * ls).reshape(-1, 1)
    offset = (dmin.float()[:, None] * lm).reshape(-1, 1)
    safe = torch.where(step == 0, torch.ones_like(step), step)
    codes = ((x + offset) / safe).round().clamp(0, _NMAX)
    codes = torch.where(step == 0, search_codes, codes).reshape(-1, Q4K_SUPER)
    raw = torch.cat([d[:, None].view(torch.uint8), dmin[:, None].view(torch.uint8), _pack_scales(ls, lm),
                     _pack_nibbles(codes)], dim=1)
    return raw.reshape(n, k // Q4K_SUPER * Q4K_BYTES).numpy()


def quantize_q4k(w: torch.Tensor) -> QuantizedWeight:
    """Q4_K as int4 with groups of 32 (scale d*sc, zero 8*d*sc - dmin*m), as gguf_int4 reads it.

    An input size that is a multiple of 32 but not of 256 ends in a short super-block: it is
    quantized as a full one whose missing sub-blocks are zeros (zero sub-blocks have scale and min
    0, so they change neither d nor dmin), and those columns are dropped again.
    """
    n, k = w.shape
    _check_blocks(k, Q4K_SUB)
    padded = -(-k // Q4K_SUPER) * Q4K_SUPER
    if padded != k:
        w = torch.cat([w.float(), w.new_zeros(n, padded - k, dtype=torch.float32)], dim=1)
    qw = gguf_int4(q4_k_blocks(w), QType.Q4_K, (n, padded))
    if padded == k:
        return qw
    groups = k // Q4K_SUB
    return QuantizedWeight("int4", qw.codes[:, :k].contiguous(), qw.scales[:, :groups].contiguous(),
                           qw.zeros[:, :groups].contiguous(), Q4K_SUB)
