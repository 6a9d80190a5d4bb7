"""Our batch-invariant fp32 CPU matmul (layers/csrc/dense_matmul.cpp: what runs fp32 models on the CPU,
an HF folder's weights or `-q none`) by row count, against MKL's (F.linear, which is not batch invariant:
layers/dense.py) and, with --compare-with, against the kernel's source at a git revision, built alone:
the kernels take turns call by call, round after round, so that load falls on all alike, and the
revision's bits are checked equal to the tree's at every row count and shape.

    .venv/bin/python benchmarks/dense_matmul.py --threads 1 --rounds 5 --compare-with HEAD~1

Shapes: the default model's (SmolLM2-135M: fused q/k/v 576x960, o 576x576, fused gate/up 576x3072, down
1536x576) and a 1.7B model's (2048x2048, 2048x8192). Cells: GFLOP/s (2 T N K over the median of the
rounds' best calls) and ms a call.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

import kernel_at  # noqa: E402
from ruvllm.cpu_build import kernels  # noqa: E402

SOURCE = Path("src/ruvllm/layers/csrc/dense_matmul.cpp")
DECLARATION = "at::Tensor dense_matmul(const at::Tensor&, const at::Tensor&)"
SCHEMA = "dense_matmul(Tensor x, Tensor w) -> Tensor"
SHAPES = {"576x960": (576, 960), "576x576": (576, 576), "576x3072": (576, 3072), "1536x576": (1536, 576),
          "2048x2048": (2048, 2048), "2048x8192": (2048, 8192)}  # K x N
ROWS = (1, 16, 64, 256, 512)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    kernel_at.add_arguments(p)
    p.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    p.add_argument("--rows", nargs="+", type=int, default=list(ROWS))
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    ext = kernels()
    if ext is None:
        raise SystemExit("the C++ kernels cannot be built here")
    fns: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {"MKL": lambda x, w: F.linear(x, w)}
    if args.compare_with:
        fns[args.compare_with] = kernel_at.standalone(kernel_at.source_at(args.compare_with, SOURCE), "dense_matmul",
                                                      DECLARATION, SCHEMA)
    fns["tree"] = ext.dense_matmul

    gen = torch.Generator().manual_seed(1)
    ws = {s: torch.randn(n, k, generator=gen) * 0.02 for s, (k, n) in SHAPES.items() if s in args.shapes}
    xs = {(s, t): torch.randn(t, SHAPES[s][0], generator=gen) for s in ws for t in args.rows}
    if args.compare_with:
        same = all(torch.equal(fns[args.compare_with](xs[(s, t)], w), fns["tree"](xs[(s, t)], w))
                   for s, w in ws.items() for t in args.rows)
        print(f"bitwise equal to {args.compare_with} at every row count and shape: {same}")

    times: dict[tuple[str, str, int], list[float]] = {}
    load = []
    for _ in range(args.rounds):
        for s, w in ws.items():
            for t in args.rows:
                x = xs[(s, t)]
                for name, fn in fns.items():
                    times.setdefault((name, s, t), []).append(kernel_at.best_of(lambda: fn(x, w), args.budget))
        load.append(float(Path("/proc/loadavg").read_text().split()[0]))

    names = list(fns)
    ours = names[1:]
    print("| K x N | rows | " + " | ".join(f"{n}: GFLOP/s | {n}: ms" for n in names) + " | "
          + " | ".join(f"{n} / MKL (time)" for n in ours) + (" | tree / " + names[1] + " (time) |" if len(ours) == 2 else " |"))
    print("|" + "---|" * (2 + 2 * len(names) + len(ours) + (len(ours) == 2)))
    for s in ws:
        k, n = SHAPES[s]
        for t in args.rows:
            med = {name: statistics.median(times[(name, s, t)]) for name in names}
            cells = [f"{2 * t * n * k / med[name] / 1e9:.1f} | {med[name] * 1e3:.3f}" for name in names]
            ratios = [f"{med[name] / med['MKL']:.2f}" for name in ours]
            if len(ours) == 2:
                ratios.append(f"{med['tree'] / med[ours[0]]:.2f}")
            print(f"| {s} | {t} | " + " | ".join(cells) + " | " + " | ".join(ratios) + " |")
    print(f"threads {args.threads}, rounds {args.rounds}, 1-min load average after each round: {load}")


if __name__ == "__main__":
    main()
