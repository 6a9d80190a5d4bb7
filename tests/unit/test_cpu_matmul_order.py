"""Our quantized CPU matmul (quant/csrc/quant_matmul.cpp) equals, bit for bit, its float arithmetic
written out in numpy in the kernel's fixed order.

Why bitwise and not within a tolerance (test_cpu_matmul.py has that one): the kernel's speed work
(issue 34) rearranges loads, registers and instructions, and must not move a single float rounding,
or every output of the default precision (its perplexity, its batch invariance against earlier runs)
changes with it. Integer block dots are exact whatever instructions compute them (AVX2 maddubs,
AVX-512 VNNI, AVX-VNNI), so one order holds on every vector path. The scalar path of a CPU without
AVX2 sums one float per output instead of eight lanes: the test is for vector builds.

The order, per output (t, n): x's block b quantized (d = absmax / 127, codes = round-half-even(x *
(1 / d)) clamped to +-127, float32 throughout); eight lanes, lane l the exact sum of the 4 products
of inputs 4l..4l+3, accumulate fma(x scale * w scale, lane, acc) over the blocks in order; the zero
points' part accumulates fma(zero - 8 w scale, x scale * code sum, ext) in the same order; then
((l0 + l4) + (l2 + l6)) + ((l1 + l5) + (l3 + l7)) + ext.
"""

from __future__ import annotations


import numpy as np
import pytest
import torch

from ruvllm.quant import cpu_matmul
from ruvllm.quant.rtn import quantize_int4, quantize_int8
from ruvllm.quant.weights import QuantizedWeight


def _vector_build() -> bool:
    """The build's target, not the CPU: a build for plain x86-64 (RUVLLM_KERNEL_ARCH, scripts/test_isa.sh)
    runs the scalar path on an AVX2 CPU."""
    from ruvllm.cpu_build import target_isa

    return {"avx2", "fma", "f16c"} <= set(target_isa())


pytestmark = [
    pytest.mark.skipif(cpu_matmul.kernels() is None, reason="no C++ compiler: the kernel cannot be built"),
    pytest.mark.skipif(not _vector_build(), reason="the scalar path (a build without AVX2) sums in another order"),
]

N, K = 8, 128  # 4 blocks of 32
F32 = np.float32


def fma32(a: np.ndarray, b: np.ndarray, c: np.ndarray) -> np.ndarray:
    """float32 a * b + c rounded once, as the FMA instruction does. a * b is exact in float64 and
    TwoSum gives the float64 sum's rounding error exactly; float64 -> float32 then rounds right
    except where the float64 sum sits exactly on a float32 midpoint, which the error's sign settles."""
    p = a.astype(np.float64) * b.astype(np.float64)
    c64 = c.astype(np.float64)
    s = p + c64
    bb = s - p
    err = (p - (s - bb)) + (c64 - bb)
    r = s.astype(F32)
    d = s - r.astype(np.float64)  # exact: s and r are close
    toward = np.nextafter(r, np.where(d > 0, F32(np.inf), F32(-np.inf)).astype(F32))
    midpoint = (d != 0) & (np.abs(d) * 2 == np.abs(toward.astype(np.float64) - r.astype(np.float64)))
    return np.where(midpoint & (np.sign(err) == np.sign(d)), toward, r)


def quantize_rows(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """x [T, K] float32 -> codes [T, K/32, 32], scales [T, K/32], code sums [T, K/32]."""
    xb = x.reshape(x.shape[0], -1, 32).astype(F32)
    d = (np.abs(xb).max(axis=2) / F32(127)).astype(F32)
    with np.errstate(divide="ignore"):
        inv = np.where(d > 0, F32(1) / d, F32(0)).astype(F32)
    q = np.clip(np.rint(xb * inv[..., None]), -127, 127).astype(np.int64)
    return q, d, q.sum(axis=2)


def reference(x: torch.Tensor, packed: cpu_matmul.Packed, n: int, k: int) -> np.ndarray:
    q, xs, qsum = quantize_rows(x.numpy())
    t, nb = xs.shape
    xsum = (xs * qsum.astype(F32)).astype(F32)
    if packed.int4:
        pc = packed.codes.numpy()
        codes = np.concatenate([pc.reshape(n, nb, 16) & 0x0F, pc.reshape(n, nb, 16) >> 4], axis=2).astype(np.int64)
    else:
        codes = packed.codes.numpy().reshape(n, nb, 32).astype(np.int64)
    per_group = packed.group // 32

    def by_row(held: torch.Tensor) -> np.ndarray:  # [N/4, K/group, 4] float16 bits -> [N, K/32] float32
        v = held.view(torch.float16).float().numpy().transpose(0, 2, 1).reshape(n, -1)
        return np.repeat(v, per_group, axis=1).astype(F32)

    ws = by_row(packed.scales)
    offset = (by_row(packed.zeros) - F32(8) * ws).astype(F32) if packed.int4 else None
    y = np.empty((t, n), F32)
    for ti in range(t):
        for ni in range(n):
            acc = np.zeros(8, F32)
            ext = F32(0)
            for b in range(nb):
                lanes = (codes[ni, b] * q[ti, b]).reshape(8, 4).sum(axis=1).astype(F32)
                scale = F32(xs[ti, b] * ws[ni, b])
                acc = fma32(np.full(8, scale, F32), lanes, acc)
                if offset is not None:
                    ext = fma32(np.array([offset[ni, b]]), np.array([xsum[ti, b]]), np.array([ext]))[0]
            v = acc[:4] + acc[4:]
            y[ti, ni] = F32(F32(v[0] + v[2]) + F32(v[1] + v[3])) + ext
    return y


def _weights() -> dict[str, QuantizedWeight]:
    g = torch.Generator().manual_seed(3)
    w = torch.randn(N, K, generator=g) * 0.05
    q8 = quantize_int8(w)
    q8_g32 = QuantizedWeight("int8", q8.codes, q8.scales[:, None].repeat(1, K // 32), None, 32)
    return {"int4 g32": quantize_int4(w, 32), "int4 g64": quantize_int4(w, 64), "int8": q8, "int8 g32": q8_g32}


WEIGHTS = _weights()


@pytest.mark.parametrize("rows", [1, 2, 5])  # decoding as it reads (1, 2 rows) and decoding each tile once
@pytest.mark.parametrize("form", list(WEIGHTS))
def test_bitwise_equal_to_the_written_out_order(form: str, rows: int) -> None:
    x = torch.randn(rows, K, generator=torch.Generator().manual_seed(rows))
    x[0, 32:64] = 0.0  # an all-zero block: scale 0
    packed = cpu_matmul.pack(WEIGHTS[form])
    ours = cpu_matmul.matmul(x, packed).numpy()
    ref = reference(x, packed, N, K)
    assert np.array_equal(ours.view(np.int32), ref.view(np.int32)), np.abs(ours - ref).max()


def test_fma32_rounds_once() -> None:
    """The emulated FMA on cases where rounding the product first, or the float64 sum, goes wrong."""
    eps = F32(2.0 ** -23)
    a = np.array([1 + eps, 1 + eps], F32)
    # (1 + e)^2 = 1 + 2e + e^2: rounding the product first drops e^2, and then - (1 + 2e) gives 0
    assert fma32(a[:1], a[:1], np.array([-(1 + 2 * eps)], F32))[0] == F32(2.0 ** -46)
    # a float64 sum exactly on a float32 midpoint, the error deciding: (2^-24 + 2^-47)(1 - 2^-23) +
    # (1 + 2^-23) is 1 + 2^-23 + 2^-24 - 2^-70, just below the midpoint, so down to 1 + 2^-23; the
    # float64 sum drops the 2^-70 and round-half-even of it would give 1 + 2^-22
    a, b, c = (np.array([v], F32) for v in (2.0 ** -24 + 2.0 ** -47, 1 - 2.0 ** -23, 1 + 2.0 ** -23))
    assert (a.astype(np.float64) * b + c).astype(F32)[0] == F32(1 + 2.0 ** -22)
    assert fma32(a, b, c)[0] == F32(1 + 2.0 ** -23)
