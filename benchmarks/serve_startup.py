"""How long `ruvllm serve` takes to answer /health, and to stop on SIGTERM, per model.

    .venv/bin/python benchmarks/serve_startup.py                 # the embedded default, 3 runs
    .venv/bin/python benchmarks/serve_startup.py PATH --runs 5   # any model ruvllm serve takes
    .venv/bin/python benchmarks/serve_startup.py --arm before=/tmp/wt/src --arm after=src --default-pool
                            # two source trees' starts alternating, run by run, with the default KV pool

Each run starts a fresh `python -m ruvllm.cli.main serve` process (interpreter, imports, the core
process, model load, tokenizer), polls /health every 20 ms until it answers 200, then sends SIGTERM
and waits for the exit. The CPU column is the user and system time of that process and the core
process it started and reaped, from start to exit. The first run after a source change includes
building the C++ kernels (~35 s); the table shows every run so that one stands out.
"""

from __future__ import annotations

import argparse
import os
import resource
import signal
import socket
import statistics
import subprocess
import sys
import time

import httpx
from rich.console import Console
from rich.table import Table


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def one_run(model: str | None, src: str | None, default_pool: bool) -> tuple[float, float, float]:
    port = _port()
    argv = [sys.executable, "-m", "ruvllm.cli.main", "serve", *([model] if model else []), "--port", str(port),
            *([] if default_pool else ["--num-blocks", "256"])]
    env = {**os.environ, "PYTHONPATH": os.path.abspath(src)} if src else None
    cpu = _children_cpu()
    start = time.monotonic()
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
    try:
        while True:
            if proc.poll() is not None:
                raise SystemExit(f"serve exited with {proc.returncode}: {proc.stderr.read().strip()}")
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.02)
        ready = time.monotonic() - start
        stop = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
        return ready, time.monotonic() - stop, _children_cpu() - cpu
    finally:
        if proc.poll() is None:
            proc.kill()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", nargs="?", help="path, alias or Hub id (default: the embedded model)")
    ap.add_argument("--runs", type=int, default=3, help="runs per arm")
    ap.add_argument("--arm", action="append", metavar="NAME=SRC",
                    help="a source tree to run (PYTHONPATH=SRC); several alternate run by run (default: this one)")
    ap.add_argument("--default-pool", action="store_true", help="serve's default KV pool (else --num-blocks 256)")
    args = ap.parse_args()
    arms = [tuple(a.split("=", 1)) for a in args.arm] if args.arm else [("this tree", None)]
    results: dict[str, list[tuple[float, float, float]]] = {name: [] for name, _ in arms}
    for _ in range(args.runs):
        for name, src in arms:
            results[name].append(one_run(args.model, src, args.default_pool))
    pool = "the default KV pool" if args.default_pool else "256 KV blocks"
    table = Table(title=f"ruvllm serve {args.model or '(embedded default)'}, {pool}: start-up and stop")
    for column in ("arm", "run", "to /health 200 (s)", "SIGTERM to exit (s)", "CPU, serve and core (s)"):
        table.add_column(column, justify="right")
    for name, runs in results.items():
        for i, (ready, stopped, cpu) in enumerate(runs, 1):
            table.add_row(name, str(i), f"{ready:.2f}", f"{stopped:.2f}", f"{cpu:.2f}")
        table.add_row(name, "median", *(f"{statistics.median(r[k] for r in runs):.2f}" for k in range(3)))
    Console().print(table)


if __name__ == "__main__":
    main()
