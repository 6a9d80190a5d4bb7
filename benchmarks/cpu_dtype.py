"""The default model's forward pass (and LM head) at fp32 and bf16 compute on this CPU, at 1, 5 and
256 rows of one sequence: what decides `dtype="auto"` on the CPU (docs/decisions.md).

    .venv/bin/python benchmarks/cpu_dtype.py
"""

from __future__ import annotations

import time

from rich.console import Console
from rich.table import Table


def step_ms(llm, rows: int, repeats: int) -> float:
    from ruvllm.outputs import ScheduledSeq, SchedulerOutput

    runner = llm.core.executor.runner
    so = SchedulerOutput(seqs=[ScheduledSeq("x", list(range(100, 100 + rows)), 100, list(range(32)), True)])
    for _ in range(2):
        runner.compute_logits(so)
    start = time.perf_counter()
    for _ in range(repeats):
        runner.compute_logits(so)
    return (time.perf_counter() - start) / repeats * 1000


def main() -> None:
    from ruvllm import LLM

    sizes = (1, 5, 256)
    table = Table(title="default model, one sequence: forward + LM head, ms (median of 3 runs)")
    table.add_column("dtype")
    for n in sizes:
        table.add_column(f"{n} row(s)", justify="right")
    results = {}
    for dtype in ("float32", "bfloat16"):
        llm = LLM(num_blocks=32, dtype=dtype)
        results[dtype] = [sorted(step_ms(llm, n, 20 if n < 100 else 3) for _ in range(3))[1] for n in sizes]
        table.add_row(dtype, *(f"{ms:.1f}" for ms in results[dtype]))
        del llm
    table.add_row("bf16 / fp32", *(f"{b / f:.2f}x" for f, b in zip(results["float32"], results["bfloat16"])))
    Console().print(table)


if __name__ == "__main__":
    main()
