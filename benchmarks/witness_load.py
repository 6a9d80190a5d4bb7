"""The witness log under load: what a completion's entry costs, and whether the chain verifies after
a 10,000-completion load through `ruvllm serve` and after the server is killed (-9) mid-load.

1. The writer alone: --entries completion entries (as the server writes them) appended and
   committed; microseconds per entry.
2. `ruvllm serve` (the embedded default model, --witness-log in a temporary folder): --completions
   completions (short prompts, 1 token each, --concurrency at once); then `ruvllm witness verify`.
3. The same server again over the same log, killed with SIGKILL while a load runs; then verify,
   then a third server continues the chain, and verify again.

    .venv/bin/python benchmarks/witness_load.py --completions 10000
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
from rich.console import Console
from rich.table import Table


def writer_cost(path: Path, n: int) -> float:
    from ruvllm.sampling_params import SamplingParams
    from ruvllm.witness.log import WitnessLog
    from ruvllm.witness.records import completion_record

    log = WitnessLog(path, model_digest=lambda: "sha256:" + "0" * 64)
    body = completion_record("m", None, SamplingParams(temperature=0.7), list(range(40)), [(list(range(60)), "stop")],
                             False)
    t = time.perf_counter()
    for i in range(n):
        log.append(f"cmpl-{i}", "completion", "default", body)
    log.flush()
    dt = time.perf_counter() - t
    log.close()
    return dt / n * 1e6


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(log: Path, *flags: str, src: str | None = None) -> tuple[subprocess.Popen, str]:
    """`ruvllm serve` (the embedded default model) in a session of its own, once /health answers.
    `src`: another source tree to run (PYTHONPATH=src; an A/B arm), else this one."""
    port = free_port()
    env = {**os.environ, "PYTHONPATH": os.path.abspath(src)} if src else None
    proc = subprocess.Popen([sys.executable, "-m", "ruvllm.cli.main", "serve", "--port", str(port), "--witness-log",
                             str(log), *flags],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True, env=env)
    url = f"http://127.0.0.1:{port}"
    for _ in range(600):
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError("the server did not start")


async def load(url: str, n: int, concurrency: int) -> tuple[int, float]:
    done = 0
    sem = asyncio.Semaphore(concurrency)
    t = time.perf_counter()
    async with httpx.AsyncClient(timeout=120) as client:
        async def one(i: int) -> None:
            nonlocal done
            async with sem:
                try:
                    r = await client.post(url + "/v1/completions", json={
                        "model": "SmolLM2-135M-Instruct", "prompt": f"Request {i}: say something.", "max_tokens": 1})
                    done += r.status_code == 200
                except httpx.HTTPError:
                    pass  # the server was killed
        await asyncio.gather(*(one(i) for i in range(n)))
    return done, time.perf_counter() - t


def verify(log: Path) -> str:
    from ruvllm.witness.log import verify as verify_chain

    v = verify_chain(log)
    return f"{v.entries} entries, verifies" if v.ok else f"BROKEN at {v.broken_at}: {v.reason}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--entries", type=int, default=10000)
    ap.add_argument("--completions", type=int, default=10000)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--kill-after", type=float, default=5.0)
    args = ap.parse_args()
    console = Console()
    table = Table(title="Witness log under load (2-core host)")
    table.add_column("what")
    table.add_column("figure")
    with tempfile.TemporaryDirectory() as tmp:
        us = writer_cost(Path(tmp) / "writer.sqlite3", args.entries)
        table.add_row(f"writer alone: {args.entries} completion entries", f"{us:.0f} us an entry (hash, insert, commit)")

        log = Path(tmp) / "served.sqlite3"
        proc, url = start_server(log)
        done, secs = asyncio.run(load(url, args.completions, args.concurrency))
        os.killpg(proc.pid, signal.SIGINT)
        proc.wait(timeout=60)
        table.add_row(f"`ruvllm serve`: {args.completions} completions, {args.concurrency} at once",
                      f"{done} answered in {secs:.0f} s ({done / secs:.0f}/s); log: {verify(log)}")

        proc, url = start_server(log)

        async def killed_mid_load() -> int:
            task = asyncio.create_task(load(url, args.completions, args.concurrency))
            await asyncio.sleep(args.kill_after)
            os.killpg(proc.pid, signal.SIGKILL)
            return (await task)[0]

        answered = asyncio.run(killed_mid_load())
        proc.wait(timeout=60)
        table.add_row(f"killed -9 after {args.kill_after:g} s of another load", f"{answered} answered; log: {verify(log)}")
        proc, url = start_server(log)
        done, _ = asyncio.run(load(url, 200, args.concurrency))
        os.killpg(proc.pid, signal.SIGINT)
        proc.wait(timeout=60)
        table.add_row("a new server on the same log: 200 more", f"{done} answered; log: {verify(log)}")
    console.print(table)


if __name__ == "__main__":
    main()
