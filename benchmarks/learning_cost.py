"""What learning from feedback costs serving: 32 streams' aggregate throughput through `ruvllm serve
--learn` (the embedded default model) with no feedback, and with feedback arriving at --rate events a
second (each an instant update and a new adapter version for its tenant), alternating for --rounds
rounds. The streams are the default tenant's (no adapter); the feedback is another tenant's, on one
of its completions, with a correction; that tenant first asks four everyday questions, so the
background loop has a Fisher to consolidate with.

    .venv/bin/python benchmarks/learning_cost.py --streams 32 --rate 5 --rounds 2 [--nice 0]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent))
from witness_load import start_server  # noqa: E402

MODEL = "SmolLM2-135M-Instruct"
LEARNER = {"Authorization": "Bearer key-learner"}
EVERYDAY = ["Write two sentences about the sea.", "What is a good way to learn a new language?",
            "Summarise a love story in three sentences.", "Give me a tip for cooking rice."]


def start(tmp: str, keys: Path, nice: int) -> tuple[object, str]:
    return start_server(Path(tmp) / "w.sqlite3", "--learn", "--api-keys", str(keys), "--feedback-rate", "100",
                        "--learned-dir", f"{tmp}/learned", "--learn-nice", str(nice))


async def streams(url: str, n: int, gen_len: int) -> tuple[int, float]:
    """n concurrent completions of gen_len tokens each: (tokens, seconds)."""
    headers = {"Authorization": "Bearer key-default"}
    async with httpx.AsyncClient(timeout=300, headers=headers) as client:
        async def one(i: int) -> int:
            r = await client.post(url + "/v1/completions", json={
                "model": MODEL, "prompt": f"Chapter {i}. It was a fine morning, and", "max_tokens": gen_len,
                "temperature": 0.8, "seed": i, "ignore_eos": True})
            return r.json()["usage"]["completion_tokens"]
        t = time.perf_counter()
        tokens = await asyncio.gather(*(one(i) for i in range(n)))
        return sum(tokens), time.perf_counter() - t


async def learner_setup(url: str) -> str:
    """The feedback tenant's completions before the rounds: four everyday questions (its traffic,
    what the background loop's Fisher is made of) and the one its feedback corrects (its id)."""
    async with httpx.AsyncClient(timeout=300, headers=LEARNER) as client:
        for q in EVERYDAY:
            await client.post(url + "/v1/chat/completions", json={
                "model": MODEL, "messages": [{"role": "user", "content": q}], "max_tokens": 32, "temperature": 0})
        r = await client.post(url + "/v1/chat/completions", json={
            "model": MODEL, "messages": [{"role": "user", "content": "What is the capital of Zorblax?"}],
            "max_tokens": 16, "temperature": 0})
        return r.json()["id"]


async def feedback_loop(url: str, rid: str, rate: float, stop: asyncio.Event, latencies: list[float]) -> None:
    async with httpx.AsyncClient(timeout=300, headers=LEARNER) as client:
        while not stop.is_set():
            t = time.perf_counter()
            r = await client.post(url + "/v1/feedback", json={"id": rid, "score": 1,
                                                              "correction": "The capital of Zorblax is Quenta."})
            if r.status_code == 200:
                latencies.append(r.json()["update_ms"])
            await asyncio.sleep(max(0.0, 1 / rate - (time.perf_counter() - t)))


async def run(url: str, n: int, gen_len: int, rate: float | None, rid: str = "") -> tuple[float, list[float]]:
    stop = asyncio.Event()
    latencies: list[float] = []
    fb = asyncio.create_task(feedback_loop(url, rid, rate, stop, latencies)) if rate else None
    tokens, secs = await streams(url, n, gen_len)
    stop.set()
    if fb is not None:
        await fb
    return tokens / secs, latencies


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--streams", type=int, default=32)
    ap.add_argument("--gen-len", type=int, default=128)
    ap.add_argument("--rate", type=float, default=5.0)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--nice", type=int, default=10, help="ruvllm serve --learn-nice")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        keys = Path(tmp) / "keys"
        keys.write_text("key-default default\nkey-learner learner\n")
        proc, url = start(tmp, keys, args.nice)
        try:
            asyncio.run(run(url, 4, 8, None))  # warm-up
            rid = asyncio.run(learner_setup(url))
            plain, learning, lat = [], [], []
            for r in range(args.rounds):
                order = [None, args.rate] if r % 2 == 0 else [args.rate, None]
                for rate in order:
                    tps, latencies = asyncio.run(run(url, args.streams, args.gen_len, rate, rid))
                    (learning if rate else plain).append(tps)
                    lat += latencies
        finally:
            os.killpg(proc.pid, signal.SIGINT)
            proc.wait(timeout=60)
    table = Table(title=f"Serving while learning: default model, {args.streams} streams x {args.gen_len} tokens, "
                        f"feedback at {args.rate:g}/s, {args.rounds} rounds, "
                        f"learning at nice {args.nice}")
    for col in ("no feedback, tok/s", "with feedback, tok/s", "ratio (median)", "updates", "update p50 / p99 (ms)"):
        table.add_column(col, justify="right")
    lat.sort()
    table.add_row(" / ".join(f"{x:.1f}" for x in plain), " / ".join(f"{x:.1f}" for x in learning),
                  f"{statistics.median(learning) / statistics.median(plain):.2f}x", str(len(lat)),
                  f"{lat[len(lat) // 2]:.1f} / {lat[min(len(lat) - 1, int(0.99 * len(lat)))]:.1f}" if lat else "-")
    Console().print(table)


if __name__ == "__main__":
    main()
