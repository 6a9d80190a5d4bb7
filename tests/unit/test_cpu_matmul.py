"""Our C++ quantized matmul (quant/csrc/quant_matmul.cpp): exact against its definition, batch
invariant bit for bit, the same at any thread count, and close to the float matmul it stands for."""

from __future__ import annotations

import pytest
import torch

from ruvllm.quant import cpu_matmul
from ruvllm.quant.rtn import quantize_int4, quantize_int8
from ruvllm.quant.weights import QuantizedWeight
from tests.unit.quant_reference import eight_bit_block_reference

pytestmark = pytest.mark.skipif(cpu_matmul.kernels() is None, reason="no C++ compiler: the kernel cannot be built")

N, K = 96, 576  # 576: SmolLM2's hidden size, 18 blocks


def _weights() -> dict[str, QuantizedWeight]:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(N, K, generator=g) * 0.05
    q8 = quantize_int8(w)
    # Q8_0's form: int8 codes with a scale per block of 32 (here: the per-channel scale, repeated).
    q8_g32 = QuantizedWeight("int8", q8.codes, q8.scales[:, None].repeat(1, K // 32), None, 32)
    return {"int4 g32": quantize_int4(w, 32), "int4 g64": quantize_int4(w, 64), "int8": q8, "int8 g32": q8_g32}


WEIGHTS = _weights()


def _x(t: int, seed: int = 1) -> torch.Tensor:
    x = torch.randn(t, K, generator=torch.Generator().manual_seed(seed))
    x[0, :32] = 0.0  # an all-zero block: scale 0, no division by it
    return x


@pytest.mark.parametrize("form", list(WEIGHTS))
def test_equals_its_definition(form: str) -> None:
    qw = WEIGHTS[form]
    x = _x(7)
    ours = cpu_matmul.matmul(x, cpu_matmul.pack(qw)).double()
    ref = eight_bit_block_reference(x, qw)
    # Integer block dots are exact; only float32 scaling and accumulation round.
    torch.testing.assert_close(ours, ref, atol=2e-5 * ref.abs().max().item(), rtol=1e-5)


@pytest.mark.parametrize("form", list(WEIGHTS))
def test_rows_do_not_depend_on_the_batch(form: str) -> None:
    packed = cpu_matmul.pack(WEIGHTS[form])
    x = _x(37)
    together = cpu_matmul.matmul(x, packed)
    for t in (0, 5, 36):
        assert torch.equal(cpu_matmul.matmul(x[t:t + 1], packed), together[t:t + 1])
    assert torch.equal(cpu_matmul.matmul(x[3:20], packed), together[3:20])
    # 1 and 2 rows decode the weights as they read them, 3 and more decode each tile once: the same bits
    for rows in (slice(7, 9), slice(7, 10), slice(0, 36)):
        assert torch.equal(cpu_matmul.matmul(x[rows], packed), together[rows])


@pytest.mark.parametrize("form", ["int4 g32", "int8 g32"])
def test_same_at_any_thread_count(form: str) -> None:
    """Threads split the output columns, never the inputs: at 640 columns, every row count's path (1
    and 2 rows decode as they read, more decode each tile once) gives one thread's bits, call after call."""
    w = torch.randn(640, K, generator=torch.Generator().manual_seed(2)) * 0.05
    packed = cpu_matmul.pack(quantize_int4(w, 32) if form == "int4 g32" else quantize_int8(w))
    before = torch.get_num_threads()
    try:
        for rows in (1, 2, 9):
            x = _x(rows)
            torch.set_num_threads(1)
            one = cpu_matmul.matmul(x, packed)
            torch.set_num_threads(2)
            assert all(torch.equal(cpu_matmul.matmul(x, packed), one) for _ in range(3))
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("form", list(WEIGHTS))
def test_close_to_the_float_matmul(form: str) -> None:
    """8-bit activations cost little: within 1% (relative to the output's scale) of x . W_dequantized."""
    qw = WEIGHTS[form]
    x = _x(16)
    exact = x @ qw.dequantize().t()
    ours = cpu_matmul.matmul(x, cpu_matmul.pack(qw))
    assert (ours - exact).abs().max() / exact.abs().max() < 0.01


def test_bf16_in_bf16_out() -> None:
    packed = cpu_matmul.pack(WEIGHTS["int4 g32"])
    x = _x(3).bfloat16()
    y = cpu_matmul.matmul(x, packed)
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y, cpu_matmul.matmul(x.float(), packed).bfloat16())


def test_packing_is_llamacpp_order() -> None:
    """Byte j of a block holds input j (low nibble) and input 16 + j (high nibble), as Q4_0 does."""
    qw = WEIGHTS["int4 g32"]
    packed = cpu_matmul.pack(qw)
    c = qw.codes
    assert int(packed.codes[0, 0]) == int(c[0, 0]) | (int(c[0, 16]) << 4)
    assert int(packed.codes[1, 17]) == int(c[1, 33]) | (int(c[1, 49]) << 4)
    # scales and zero points [N/4, K/32, 4]: a tile of 4 rows' values of one group side by side
    assert packed.scales.shape == packed.zeros.shape == (N // 4, K // 32, 4)
    assert packed.scales.dtype == packed.zeros.dtype == torch.int16  # float16 bits
    assert float(packed.scales.view(torch.float16)[1, 2, 3]) == float(qw.scales[7, 2].half())
    assert float(packed.zeros.view(torch.float16)[2, 0, 1]) == float(qw.zeros[9, 0].half())


@pytest.mark.parametrize("form", ["int4 g32", "int4 g64", "int8"])
def test_packed_bytes_are_what_the_plan_counts(form: str) -> None:
    from ruvllm.quant.weights import estimate_bytes

    qw = WEIGHTS[form]
    assert cpu_matmul.pack(qw).nbytes == estimate_bytes(qw.kind, N, K, qw.group_size)
