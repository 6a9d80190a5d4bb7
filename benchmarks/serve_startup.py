"""How long `ruvllm serve` takes to answer /health, and to stop on SIGTERM, per model.

    .venv/bin/python benchmarks/serve_startup.py                 # the embedded default, 3 runs
    .venv/bin/python benchmarks/serve_startup.py PATH --runs 5   # any model ruvllm serve takes

Each run starts a fresh `python -m ruvllm.cli.main serve` process (interpreter, imports, the core
process, model load, tokenizer), polls /health every 20 ms until it answers 200, then sends SIGTERM
and waits for the exit. The first run after a source change includes building the C++ attention
kernel (~35 s); the table shows every run so that one stands out.
"""

from __future__ import annotations

import argparse
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


def one_run(model: str | None) -> tuple[float, float]:
    port = _port()
    argv = [sys.executable, "-m", "ruvllm.cli.main", "serve", *([model] if model else []), "--port", str(port),
            "--num-blocks", "256"]
    start = time.monotonic()
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
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
        return ready, time.monotonic() - stop
    finally:
        if proc.poll() is None:
            proc.kill()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", nargs="?", help="path, alias or Hub id (default: the embedded model)")
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    table = Table(title=f"ruvllm serve {args.model or '(embedded default)'}: start-up and stop")
    table.add_column("run", justify="right")
    table.add_column("to /health 200 (s)", justify="right")
    table.add_column("SIGTERM to exit (s)", justify="right")
    results = [one_run(args.model) for _ in range(args.runs)]
    for i, (ready, stopped) in enumerate(results, 1):
        table.add_row(str(i), f"{ready:.2f}", f"{stopped:.2f}")
    table.add_row("median", f"{statistics.median(r for r, _ in results):.2f}",
                  f"{statistics.median(s for _, s in results):.2f}")
    Console().print(table)


if __name__ == "__main__":
    main()
