"""Triton kernels for the fused layer ops of `ruvllm.layers.ops` (imported only by `ops.triton_ops`).

Every kernel loads its inputs, converts them to float32 at once, does all arithmetic in float32 and
converts back to the output's dtype on store (fp32, fp16 and bf16 tensors alike). Sizes need not be
powers of two: the last dimension is covered by power-of-two blocks with masks.

Only long-standing `triton.language` calls are used (load/store/arange/sum/rsqrt/sigmoid,
program_id, constexpr): the same source runs under triton 3.6 on the GPU machines and under the
interpreter (TRITON_INTERPRET=1, set before this module is imported) in the CPU tests.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Rows longer than this are walked in chunks of this many elements (rms norm). 4096 fp32 per
# program keeps a chunk in registers with 8 warps (16 values a thread) without spilling.
_MAX_ROW_BLOCK = 4096


def _num_warps(block: int) -> int:
    return max(1, min(8, block // 256))


# --- rms norm ----------------------------------------------------------------------------------
# Two passes over the row, in BLOCK chunks: the first sums the squares (and, fused with the
# residual add, writes the new residual), the second normalizes. The alternative, one block holding
# the whole row in registers, reads the row once, but it caps the hidden size (or spills: 14336
# fp32 values are 56 a thread at 8 warps) and needs a second kernel for big rows. The second pass
# re-reads a row of at most a few tens of KB that the first pass just brought into L1/L2, so DRAM
# traffic is still one read of the inputs and one write per output, the same as a one-block kernel.
# One program per row: T rows (or T * heads for the per-head q/k norm) are plenty of programs.
# Measured on an H100 (bf16, T=4096, triton 3.6): add+norm at H=4096 51 us vs torch's 68 (~2.5 TB/s);
# the per-head q/k norm (rows of 128) 84 us vs 131, only ~0.8 TB/s: rows that short leave each
# program little work, and a tile of several heads per program would do better. At decode sizes
# (T <= 64) every op here, torch's included, is launch-bound (5-15 us), so fusing pays there by
# cutting launches (CUDA graphs hide the rest).

@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, n_cols, eps,
                     stride_xt, stride_xh, stride_ot, stride_oh,
                     BLOCK: tl.constexpr):
    # Row (t, h) of an [T, heads, D] input (heads == 1 for [T, H]); the last dim has stride 1.
    t = tl.program_id(0)
    h = tl.program_id(1)
    x_row = x_ptr + t.to(tl.int64) * stride_xt + h.to(tl.int64) * stride_xh
    o_row = out_ptr + t.to(tl.int64) * stride_ot + h.to(tl.int64) * stride_oh
    cols = tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, n_cols, BLOCK):
        mask = start + cols < n_cols
        x = tl.load(x_row + start + cols, mask=mask, other=0.0).to(tl.float32)
        acc += x * x
    inv_rms = tl.rsqrt(tl.sum(acc, axis=0) / n_cols + eps)
    for start in range(0, n_cols, BLOCK):
        mask = start + cols < n_cols
        x = tl.load(x_row + start + cols, mask=mask, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + start + cols, mask=mask, other=0.0).to(tl.float32)
        y = x * inv_rms * w
        tl.store(o_row + start + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _add_rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, new_res_ptr, n_cols, eps,
                         stride_x, stride_r, stride_o, stride_n,
                         BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_x
    r_row = res_ptr + row * stride_r
    o_row = out_ptr + row * stride_o
    n_row = new_res_ptr + row * stride_n
    cols = tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, n_cols, BLOCK):
        mask = start + cols < n_cols
        x = tl.load(x_row + start + cols, mask=mask, other=0.0).to(tl.float32)
        r = tl.load(r_row + start + cols, mask=mask, other=0.0).to(tl.float32)
        s = (x + r).to(new_res_ptr.dtype.element_ty)
        tl.store(n_row + start + cols, s, mask=mask)
        # The norm is of the residual as stored (rounded to its dtype), as in `x = x + o; rms_norm(x)`.
        s32 = s.to(tl.float32)
        acc += s32 * s32
    inv_rms = tl.rsqrt(tl.sum(acc, axis=0) / n_cols + eps)
    for start in range(0, n_cols, BLOCK):
        mask = start + cols < n_cols
        # Recompute the sum rather than re-read the stored residual: a load of another thread's
        # store in the same program would need a barrier; the inputs are still in L1/L2.
        x = tl.load(x_row + start + cols, mask=mask, other=0.0).to(tl.float32)
        r = tl.load(r_row + start + cols, mask=mask, other=0.0).to(tl.float32)
        s = (x + r).to(new_res_ptr.dtype.element_ty).to(tl.float32)
        w = tl.load(w_ptr + start + cols, mask=mask, other=0.0).to(tl.float32)
        y = s * inv_rms * w
        tl.store(o_row + start + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def _last_dim_unit(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """rms norm over the last dim of [T, H] or [T, heads, D] (which may be a strided view)."""
    if x.dim() not in (2, 3):
        raise ValueError(f"rms_norm takes [T, H] or [T, heads, D], got shape {tuple(x.shape)}")
    x = _last_dim_unit(x)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    n_cols = x.shape[-1]
    if x.numel() == 0:
        return out
    heads = x.shape[1] if x.dim() == 3 else 1
    sxh = x.stride(1) if x.dim() == 3 else 0
    soh = out.stride(1) if x.dim() == 3 else 0
    block = min(triton.next_power_of_2(n_cols), _MAX_ROW_BLOCK)
    _rms_norm_kernel[(x.shape[0], heads)](
        x, weight, out, n_cols, float(eps), x.stride(0), sxh, out.stride(0), soh,
        BLOCK=block, num_warps=_num_warps(block))
    return out


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual) * weight, x + residual); residual None: (rms_norm(x) * weight, x)."""
    if residual is None:
        return rms_norm(x, weight, eps), x
    if x.shape != residual.shape or x.dim() != 2 or x.dtype != residual.dtype:
        raise ValueError(f"add_rms_norm takes x and residual of one [T, H] shape and dtype, got "
                         f"{tuple(x.shape)} {x.dtype} and {tuple(residual.shape)} {residual.dtype}")
    x, residual = _last_dim_unit(x), _last_dim_unit(residual)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    new_res = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    n_cols = x.shape[-1]
    if x.numel() == 0:
        return out, new_res
    block = min(triton.next_power_of_2(n_cols), _MAX_ROW_BLOCK)
    _add_rms_norm_kernel[(x.shape[0],)](
        x, residual, weight, out, new_res, n_cols, float(eps),
        x.stride(0), residual.stride(0), out.stride(0), new_res.stride(0),
        BLOCK=block, num_warps=_num_warps(block))
    return out, new_res


# --- silu and mul ------------------------------------------------------------------------------
# Elementwise, so no row loop: a 2-D grid of (row, column block). Fusing pays: torch reads gate,
# writes silu(gate), reads it back with up and writes the product (two launches, 5I elements moved
# a row); the kernel reads 2I and writes I in one launch.

@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, n_cols, stride_x, stride_o, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    y = gate * tl.sigmoid(gate) * up
    tl.store(out_ptr + row * stride_o + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [T, 2I] -> silu(gate_up[:, :I]) * gate_up[:, I:], [T, I]."""
    if gate_up.dim() != 2 or gate_up.shape[-1] % 2:
        raise ValueError(f"silu_and_mul takes [T, 2I], got shape {tuple(gate_up.shape)}")
    x = _last_dim_unit(gate_up)
    n_cols = x.shape[-1] // 2
    out = torch.empty((x.shape[0], n_cols), dtype=x.dtype, device=x.device)
    if out.numel() == 0:
        return out
    block = min(triton.next_power_of_2(n_cols), 1024)
    _silu_and_mul_kernel[(x.shape[0], triton.cdiv(n_cols, block))](
        x, out, n_cols, x.stride(0), out.stride(0), BLOCK=block, num_warps=_num_warps(block))
    return out


# --- rotary embedding --------------------------------------------------------------------------
# Neox half-split layout: out[:h] = x[:h] * cos[:h] - x[h:] * sin[:h], out[h:] = x[h:] * cos[h:] +
# x[:h] * sin[h:] (h = D / 2). Both halves of cos/sin are loaded, so any table works, not only one
# whose halves are equal. One program per (token, block of heads); the input may be any strided
# view (q and k are views into the fused q/k/v projection output), the output is contiguous. It
# pays for the copy it replaces: torch builds the rotated half with a cat and does three more
# elementwise passes over q and k, plus a .contiguous() later.

@triton.jit
def _rope_kernel(x_ptr, cos_ptr, sin_ptr, out_ptr, n_heads, half,
                 stride_xt, stride_xh, stride_xd, stride_ct, stride_cd, stride_st, stride_sd,
                 stride_ot, stride_oh,
                 BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    dims = tl.arange(0, BLOCK_D)
    dmask = dims < half
    c1 = tl.load(cos_ptr + t * stride_ct + dims * stride_cd, mask=dmask, other=0.0).to(tl.float32)
    c2 = tl.load(cos_ptr + t * stride_ct + (dims + half) * stride_cd, mask=dmask, other=0.0).to(tl.float32)
    s1 = tl.load(sin_ptr + t * stride_st + dims * stride_sd, mask=dmask, other=0.0).to(tl.float32)
    s2 = tl.load(sin_ptr + t * stride_st + (dims + half) * stride_sd, mask=dmask, other=0.0).to(tl.float32)
    mask = (heads[:, None] < n_heads) & dmask[None, :]
    x_base = x_ptr + t * stride_xt + heads[:, None].to(tl.int64) * stride_xh
    x1 = tl.load(x_base + dims[None, :] * stride_xd, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_base + (dims[None, :] + half) * stride_xd, mask=mask, other=0.0).to(tl.float32)
    y1 = x1 * c1[None, :] - x2 * s1[None, :]
    y2 = x2 * c2[None, :] + x1 * s2[None, :]
    o_base = out_ptr + t * stride_ot + heads[:, None].to(tl.int64) * stride_oh
    tl.store(o_base + dims[None, :], y1.to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(o_base + dims[None, :] + half, y2.to(out_ptr.dtype.element_ty), mask=mask)


def _rope_one(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    n_tokens, n_heads, head_dim = x.shape
    out = torch.empty((n_tokens, n_heads, head_dim), dtype=torch.promote_types(x.dtype, cos.dtype),
                      device=x.device)
    if out.numel() == 0:
        return out
    half = head_dim // 2
    block_d = triton.next_power_of_2(half)
    block_h = min(triton.next_power_of_2(n_heads), max(1, 2048 // block_d))
    _rope_kernel[(n_tokens, triton.cdiv(n_heads, block_h))](
        x, cos, sin, out, n_heads, half,
        x.stride(0), x.stride(1), x.stride(2), cos.stride(0), cos.stride(-1), sin.stride(0), sin.stride(-1),
        out.stride(0), out.stride(1),
        BLOCK_H=block_h, BLOCK_D=block_d, num_warps=_num_warps(block_h * block_d))
    return out


def rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
         ) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, Hq, D], k [T, Hkv, D] (strided views allowed), cos/sin [T, 1, D] -> contiguous q, k.

    Two launches (q, then k): one launch for both would need both sets of strides and a branch on
    the program id for a saving of a few microseconds, which CUDA graphs hide anyway."""
    if q.dim() != 3 or k.dim() != 3 or q.shape[-1] % 2 or q.shape[-1] != k.shape[-1]:
        raise ValueError(f"rope takes q [T, Hq, D] and k [T, Hkv, D] with even D, got "
                         f"{tuple(q.shape)} and {tuple(k.shape)}")
    if cos.shape[0] != q.shape[0] or cos.shape[-1] != q.shape[-1] or sin.shape != cos.shape:
        raise ValueError(f"rope takes cos/sin [T, 1, D], got {tuple(cos.shape)} and {tuple(sin.shape)}")
    return _rope_one(q, cos, sin), _rope_one(k, cos, sin)
