"""Our quantized CPU matmul (quant/csrc/quant_matmul.cpp) at a realistic model's matrix sizes, by row count
(issue 34): where it stands against the compute and memory rooflines at 1 row (decode) and at many rows
(prefill, batched decode).

The shapes are SmolLM2-1.7B's projections (hidden 2048, FFN 8192): 2048x2048 (q/o), 2048x8192
(gate/up, K=2048 -> N=8192) and 8192x2048 (down, K=8192 -> N=2048), with Q4_0 and Q4_K bodies
(and Q8_0, the tied table's type, on request; random normal weights at std 0.02, quantized by the `gguf` package's Q4_0 and our port of
llama.cpp's Q4_K, then loaded as the engine loads them: quant/gguf_blocks.py). Each call is timed
wall clock; a cell is the median over rounds of the best of a few calls within a round.

`--compare-with REV` builds the kernel source as it is at git revision REV as a second, standalone
extension (the source with a one-operator registration of its own), times both kernels taking turns
(round after round, old then new, so that load from other processes falls on both alike), prints both
and their ratio, and checks that both give the same bits on random inputs at every row count.

    .venv/bin/python benchmarks/quant_matmul_rows.py --rounds 5
    .venv/bin/python benchmarks/quant_matmul_rows.py --rounds 5 --compare-with HEAD~1

Columns: rows (T), int8 GOP/s (2 ops a multiply-add, T x N x K of them: the work llama.cpp's pp512 figure
implies too), weight GB/s (the packed weight bytes per call over the time: the memory side at few rows),
ms a call.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
from gguf import GGMLQuantizationType as QType
from gguf import quants

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

import kernel_at  # noqa: E402
from ruvllm.quant import cpu_matmul  # noqa: E402
from ruvllm.quant.gguf_blocks import gguf_int4, gguf_int8  # noqa: E402
from ruvllm.quant.llamacpp import q4_k_blocks  # noqa: E402

SOURCE = Path("src/ruvllm/quant/csrc/quant_matmul.cpp")
DECLARATION = ("at::Tensor quant_matmul(const at::Tensor&, const at::Tensor&, const at::Tensor&, "
               "const std::optional<at::Tensor>&, int64_t, bool)")
SCHEMA = "quant_matmul(Tensor x, Tensor codes, Tensor scales, Tensor? zeros, int group, bool int4) -> Tensor"
# (K, N) of SmolLM2-1.7B's projections: q/o, gate/up, down
SHAPES = {"2048x2048": (2048, 2048), "2048x8192": (2048, 8192), "8192x2048": (8192, 2048)}
# (K, N) of the default model's (SmolLM2-135M) projections as the learner runs them (issue 37 item 1): its
# forward (fused q/k/v, o, fused gate/up, down) and its 8-bit backward over their transposes (q8_0)
SMALL_SHAPES = {"576x960": (576, 960), "576x576": (576, 576), "576x3072": (576, 3072), "1536x576": (1536, 576),
                "960x576": (960, 576), "3072x576": (3072, 576), "576x1536": (576, 1536)}
SHAPES.update(SMALL_SHAPES)
ROWS = (1, 8, 32, 128, 512)
WEIGHT_STD = 0.02


def weight(body: str, k: int, n: int, seed: int) -> cpu_matmul.Packed:
    """A random [n, k] weight quantized to `body`, in the engine's packed form."""
    w = np.random.default_rng(seed).standard_normal((n, k), dtype=np.float32) * WEIGHT_STD
    if body == "q8_0":  # the tied table's type: the LM head's matmul
        return cpu_matmul.pack(gguf_int8(np.asarray(quants.quantize(w, QType.Q8_0)).reshape(n, -1), (n, k)))
    if body == "q4_0":
        raw, qtype = quants.quantize(w, QType.Q4_0), QType.Q4_0
    else:
        raw, qtype = q4_k_blocks(torch.from_numpy(w)), QType.Q4_K
    return cpu_matmul.pack(gguf_int4(np.asarray(raw).reshape(n, -1), qtype, (n, k)))


def source_at(rev: str | None) -> str:
    """The kernel's source at git revision `rev` (None: as it is in the tree)."""
    return kernel_at.source_at(rev, SOURCE)


def standalone(text: str) -> Callable[..., torch.Tensor]:
    """A kernel source built alone, with its own operator name."""
    return kernel_at.standalone(text, "quant_matmul", DECLARATION, SCHEMA)


def current() -> Callable[..., torch.Tensor]:
    ext = cpu_matmul.kernels()
    if ext is None:
        raise SystemExit("the C++ kernels cannot be built here")
    return ext.quant_matmul


def call(fn: Callable[..., torch.Tensor], x: torch.Tensor, w: cpu_matmul.Packed) -> torch.Tensor:
    return fn(x, w.codes, w.scales, w.zeros, w.group, w.int4)


def time_call(fn: Callable[..., torch.Tensor], x: torch.Tensor, w: cpu_matmul.Packed, budget_s: float,
              clock: Callable[[], float]) -> float:
    return kernel_at.best_of(lambda: call(fn, x, w), budget_s, clock)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--bodies", nargs="+", default=["q4_0", "q4_k"], choices=["q4_0", "q4_k", "q8_0"])
    p.add_argument("--shapes", nargs="+", default=[s for s in SHAPES if s not in SMALL_SHAPES], choices=list(SHAPES))
    p.add_argument("--rows", nargs="+", type=int, default=list(ROWS))
    p.add_argument("--budget", type=float, default=0.3, help="seconds of calls per cell and round")
    p.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                   help="cpu: the process's CPU time, with --threads 1 the kernel's own work even while other "
                        "processes load the machine (wall time then mostly measures one's share of the cores)")
    p.add_argument("--compare-with", metavar="REV", help="also time the kernel source at this git revision")
    p.add_argument("--candidate", type=Path, metavar="FILE",
                   help="time this kernel source instead of the tree's (to try a change before it goes in the "
                        "tree, where every process's next kernel load would rebuild with it)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.clock == "cpu" and args.threads != 1:
        p.error("--clock cpu counts every thread's time, spinning included: use it with --threads 1")
    clock = time.perf_counter if args.clock == "wall" else time.process_time

    kernels: dict[str, Callable[..., torch.Tensor]] = {}
    if args.compare_with:
        kernels[args.compare_with] = standalone(source_at(args.compare_with))
    kernels["tree"] = current() if args.candidate is None else standalone(args.candidate.read_text())

    gen = torch.Generator().manual_seed(1)
    xs = {(k, t): torch.randn(t, k, generator=gen) for k, _ in SHAPES.values() for t in args.rows}
    weights = {(b, s): weight(b, *SHAPES[s], seed=i) for i, (b, s) in
               enumerate((b, s) for b in args.bodies for s in args.shapes)}

    if len(kernels) == 2:
        same = all(torch.equal(*(call(fn, xs[(SHAPES[s][0], t)], w) for fn in kernels.values()))
                   for (b, s), w in weights.items() for t in args.rows)
        print(f"bitwise equal to {args.compare_with} at every row count and shape: {same}")

    times: dict[tuple[Any, ...], list[float]] = {}
    load: list[float] = []
    for _ in range(args.rounds):
        for (b, s), w in weights.items():
            for t in args.rows:
                x = xs[(SHAPES[s][0], t)]
                for name, fn in kernels.items():
                    times.setdefault((name, b, s, t), []).append(time_call(fn, x, w, args.budget, clock))
        load.append(float(Path("/proc/loadavg").read_text().split()[0]))

    names = list(kernels)
    head = "| body | K x N | rows | " + " | ".join(f"{n}: GOP/s | {n}: weight GB/s | {n}: ms" for n in names)
    print(head + (" | speed-up |" if len(names) == 2 else " |"))
    print("|" + "---|" * (3 + 3 * len(names) + (len(names) == 2)))
    for (b, s), w in weights.items():
        k, n = SHAPES[s]
        for t in args.rows:
            cells, meds = [], []
            for name in names:
                sec = statistics.median(times[(name, b, s, t)])
                meds.append(sec)
                cells += [f"{2 * t * n * k / sec / 1e9:.1f}", f"{w.nbytes / sec / 1e9:.1f}", f"{sec * 1e3:.3f}"]
            ratio = f" {meds[0] / meds[1]:.2f}x |" if len(names) == 2 else ""
            print(f"| {b} | {k}x{n} | {t} | " + " | ".join(cells) + " |" + ratio)
    print(f"{args.clock} clock, threads {args.threads}, rounds {args.rounds}, 1-min load average after each round: {load}")


if __name__ == "__main__":
    main()
