"""Clients that misbehave on purpose, against a running ruvllm server: the disconnect fuzz and the
soak with random drops (issue 12). The test suite runs short versions; run this script for the full
probes and record what it prints in docs/server.md.

    python benchmarks/adversarial_clients.py --url http://127.0.0.1:8000 --disconnects 1000
    python benchmarks/adversarial_clients.py --url http://127.0.0.1:8000 --soak-seconds 300 --clients 96
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import httpx

DROP_POINTS = ("partial-request", "after-send", "after-first-byte", "mid-body", "complete")


def random_request(rng: random.Random, model: str) -> tuple[str, dict]:
    """A chat or completion request, streaming or not, with n of 1 or 2 and a short output."""
    stream = rng.random() < 0.5
    common = {"model": model, "max_tokens": rng.randint(2, 16), "stream": stream, "ignore_eos": rng.random() < 0.5,
              "temperature": rng.choice([0, 0.7]), "n": rng.choice([1, 1, 2])}
    if rng.random() < 0.5:
        return "/v1/chat/completions", {**common, "messages": [{"role": "user", "content": f"Count to {rng.randint(2, 9)}."}]}
    return "/v1/completions", {**common, "prompt": f"The number {rng.randint(0, 999)} is"}


def _raw(path: str, body: dict) -> bytes:
    data = json.dumps(body).encode()
    head = (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n")
    return head.encode() + data


@dataclass
class FuzzResult:
    drops: Counter = field(default_factory=Counter)
    completed_ok: int = 0
    failures: list[str] = field(default_factory=list)  # complete requests that did not end well


async def _one_dropped(url: str, rng: random.Random, model: str, result: FuzzResult) -> None:
    path, body = random_request(rng, model)
    raw = _raw(path, body)
    drop = rng.choice(DROP_POINTS)
    result.drops[drop] += 1
    parts = urlsplit(url)
    reader, writer = await asyncio.open_connection(parts.hostname, parts.port)
    try:
        if drop == "partial-request":
            writer.write(raw[:rng.randrange(1, len(raw))])
            await writer.drain()
            await asyncio.sleep(rng.uniform(0, 0.05))
            return
        writer.write(raw)
        await writer.drain()
        if drop == "after-send":  # mostly before the engine has taken it, or while it waits
            await asyncio.sleep(rng.uniform(0, 0.2))
            return
        first = await asyncio.wait_for(reader.read(1), 60)
        if drop == "after-first-byte":
            return
        if drop == "mid-body":
            await asyncio.wait_for(reader.read(rng.randint(50, 1500)), 60)
            return
        data = first + await asyncio.wait_for(reader.read(), 120)
        status = int(data.split(b" ", 2)[1])
        ok = status == 200 and (not body["stream"] or b"data: [DONE]" in data) and b'"error"' not in data
        if ok:
            result.completed_ok += 1
        else:
            result.failures.append(f"{path} -> {data[:300]!r}")
    finally:
        if rng.random() < 0.5:
            writer.transport.abort()  # a reset, as from a killed client
        else:
            writer.close()


async def disconnect_fuzz(url: str, count: int, model: str, seed: int = 0, concurrency: int = 16) -> FuzzResult:
    """`count` requests of mixed kinds, each dropped at a random point from a half-sent request to
    mid-stream (a fifth run to the end and must succeed)."""
    result = FuzzResult()
    gate = asyncio.Semaphore(concurrency)

    async def run(i: int) -> None:
        async with gate:
            await _one_dropped(url, random.Random(seed * 100_003 + i), model, result)

    await asyncio.gather(*(run(i) for i in range(count)))
    return result


@dataclass
class SoakResult:
    completed: int = 0
    dropped: int = 0
    statuses: Counter = field(default_factory=Counter)
    lost: list[str] = field(default_factory=list)  # requests not dropped that did not finish well


async def _complete(c: httpx.AsyncClient, path: str, body: dict, result: SoakResult) -> None:
    """One request to its end; anything short of a whole answer is recorded as lost."""
    if not body["stream"]:
        r = await c.post(path, json=body)
        result.statuses[r.status_code] += 1
        data = r.json() if r.headers.get("content-type", "").startswith("application/json") else {}
        if r.status_code != 200 or any(ch.get("finish_reason") is None for ch in data.get("choices", [None])):
            result.lost.append(f"{path} {r.status_code}: {r.text[:200]}")
            return
        result.completed += 1
        return
    async with c.stream("POST", path, json=body) as r:
        result.statuses[r.status_code] += 1
        lines = [ln async for ln in r.aiter_lines() if ln.startswith("data: ")]
    finished = sum('"finish_reason": "' in ln or '"finish_reason":"' in ln for ln in lines)
    if r.status_code != 200 or not lines or lines[-1] != "data: [DONE]" or any('"error"' in ln for ln in lines) \
            or finished < body["n"]:
        result.lost.append(f"{path} {r.status_code}: {lines[-3:]}")
        return
    result.completed += 1


async def soak(url: str, seconds: float, clients: int, drop_rate: float, model: str, seed: int = 0,
               min_completed: int = 0, min_dropped: int = 0, max_seconds: float = 120.0) -> SoakResult:
    """`clients` clients send requests back to back for `seconds`, and on (up to `max_seconds`) until
    `min_completed` requests completed and `min_dropped` were dropped, so that a slow or busy
    machine still puts as many through; each request is dropped with probability `drop_rate` at a
    random moment in its first half second."""
    result = SoakResult()
    start = time.monotonic()

    def going() -> bool:
        elapsed = time.monotonic() - start
        short = result.completed < min_completed or result.dropped < min_dropped
        return elapsed < seconds or (short and elapsed < max_seconds)

    limits = httpx.Limits(max_connections=clients * 2, max_keepalive_connections=clients)
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as c:
        async def client(i: int) -> None:
            rng = random.Random(seed * 100_003 + i)
            while going():
                path, body = random_request(rng, model)
                task = asyncio.create_task(_complete(c, path, body, result))
                if rng.random() < drop_rate:
                    await asyncio.sleep(rng.uniform(0, 0.5))
                    if not task.done():
                        task.cancel()
                        result.dropped += 1
                    await asyncio.gather(task, return_exceptions=True)
                else:
                    try:
                        await task
                    except Exception as exc:  # a transport error is a lost request too
                        result.lost.append(f"{path}: {type(exc).__name__}: {exc}")

        await asyncio.gather(*(client(i) for i in range(clients)))
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--model", default=None, help="model id (default: the server's first)")
    ap.add_argument("--disconnects", type=int, default=0)
    ap.add_argument("--soak-seconds", type=float, default=0)
    ap.add_argument("--clients", type=int, default=96)
    ap.add_argument("--drop-rate", type=float, default=0.1)
    args = ap.parse_args()
    model = args.model or httpx.get(f"{args.url}/v1/models").json()["data"][0]["id"]
    failed = False
    if args.disconnects:
        t0 = time.monotonic()
        fuzz = asyncio.run(disconnect_fuzz(args.url, args.disconnects, model))
        health = httpx.get(f"{args.url}/health")
        print(f"| disconnect fuzz | {args.disconnects} requests in {time.monotonic() - t0:.0f} s | drops "
              f"{dict(fuzz.drops)} | completed ok {fuzz.completed_ok} | failures {len(fuzz.failures)} | "
              f"/health {health.status_code} |")
        failed |= bool(fuzz.failures) or health.status_code != 200
    if args.soak_seconds:
        res = asyncio.run(soak(args.url, args.soak_seconds, args.clients, args.drop_rate, model))
        fives = sum(n for s, n in res.statuses.items() if s >= 500)
        print(f"| soak | {args.soak_seconds:.0f} s, {args.clients} clients, {args.drop_rate:.0%} drops | completed "
              f"{res.completed} | dropped {res.dropped} | lost {len(res.lost)} | 5xx {fives} | statuses "
              f"{dict(res.statuses)} | {res.completed / args.soak_seconds:.1f} requests/s |")
        for line in res.lost[:10]:
            print("lost:", line)
        failed |= bool(res.lost) or fives > 0
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
