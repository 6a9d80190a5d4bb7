"""Our C++ matmuls (fp32, and quantized) against PyTorch's CPU paths, side by side, on the default
model's shapes.

    .venv/bin/python benchmarks/quant_matmul.py                # 1 and 32 rows, 2 threads
    .venv/bin/python benchmarks/quant_matmul.py --rows 1 4 16 64 256 --threads 1

Microseconds per call (median of --calls after warm-up) for each [rows, K] x [N, K]^T:
fp32 F.linear (MKL) as it is and padded as the engine had to call it for batch invariance (a few
rows padded to 4, layers/dense.py), our batch-invariant fp32 kernel, bf16 F.linear, PyTorch's packed
int8/int4 weight-only kernels (bf16 activations, as QuantLinear feeds them), and ours (int4 / int8
weights in blocks of 32, 8-bit activations).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F
from rich.console import Console
from rich.table import Table

from ruvllm.layers.dense import dense_linear, padded_linear
from ruvllm.quant import cpu_matmul
from ruvllm.quant.linear import QuantLinear
from ruvllm.quant.rtn import quantize_int4, quantize_int8

# SmolLM2-135M: q/k/v fused (576 -> 960), gate/up fused (576 -> 3072), down (1536 -> 576), LM head.
SHAPES = {"qkv 960x576": (960, 576), "gate_up 3072x576": (3072, 576), "down 576x1536": (576, 1536),
          "lm_head 49152x576": (49152, 576)}


def _time(fn, calls: int) -> float:
    for _ in range(3):
        fn()
    samples = []
    for _ in range(calls):
        t = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t)
    return statistics.median(samples) * 1e6


def _torch_layer(qw) -> QuantLinear:
    """A QuantLinear on PyTorch's packed kernels: as built where our kernels are not."""
    ours = cpu_matmul.kernels
    cpu_matmul.kernels = lambda: None
    try:
        layer = QuantLinear(qw)
    finally:
        cpu_matmul.kernels = ours
    assert not layer.cpu_kernel
    return layer


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--calls", type=int, default=50)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if cpu_matmul.kernels() is None:
        raise SystemExit("the C++ quantized matmul could not be built on this machine")
    table = Table(title=f"us per call, {args.threads} threads (lower is better)")
    for col in ("shape", "rows", "fp32 MKL", "fp32 MKL padded", "ours fp32", "bf16", "torch int8 (bf16 act)",
                "torch int4 g32 (bf16 act)", "ours int8", "ours int4 g32", "ours int4 vs fp32"):
        table.add_column(col, justify="right")
    for label, (n, k) in SHAPES.items():
        w = torch.randn(n, k) * 0.05
        wb = w.bfloat16()
        q4, q8 = quantize_int4(w, 32), quantize_int8(w)
        torch_int4, torch_int8 = _torch_layer(q4), _torch_layer(q8)
        ours4, ours8 = cpu_matmul.pack(q4), cpu_matmul.pack(q8)
        for rows in args.rows:
            x = torch.randn(rows, k)
            xb = x.bfloat16()
            calls = max(5, args.calls // (8 if n > 10000 else 1))
            fp32 = _time(lambda: F.linear(x, w), calls)
            padded = _time(lambda: padded_linear(x, w), calls)
            ours32 = _time(lambda: dense_linear(x, w), calls)
            bf16 = _time(lambda: F.linear(xb, wb), calls)
            t8 = _time(lambda: torch_int8(xb), calls)
            t4 = _time(lambda: torch_int4(xb), calls)
            o8 = _time(lambda: cpu_matmul.matmul(x, ours8), calls)
            o4 = _time(lambda: cpu_matmul.matmul(x, ours4), calls)
            cells = (fp32, padded, ours32, bf16, t8, t4, o8, o4)
            table.add_row(label, str(rows), *(f"{v:.0f}" for v in cells), f"{fp32 / o4:.2f}x")
    Console(width=200).print(table)


if __name__ == "__main__":
    main()
