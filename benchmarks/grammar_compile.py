"""What a runaway grammar compile costs everyone else (issue 33, item 1), through `ruvllm serve`.

    .venv/bin/python benchmarks/grammar_compile.py                    # the embedded default model, 3 rounds
    .venv/bin/python benchmarks/grammar_compile.py --rounds 5 --grammar-compile-timeout 5 --threads 1

Starts a fresh `python -m ruvllm.cli.main serve` (its core in a child process, compiles in that core's
compile child) and measures, each round, first with nothing else running and then while a runaway
compile runs (an object of 8 strings of maxLength 200,000: under 500 bytes, within every limit, and most of
a minute of xgrammar), alternating:
  - plain: a chat request of --tokens tokens (temperature 0, ignore_eos);
  - structured, cached: a small `guided_choice` whose grammar compiled before (no compile);
  - structured, new: a `guided_choice` never seen before (one compile; during a runaway it is compiled
    beside it once the runaway has run past 1 s, docs/structured.md "The engine core").
Medians over every request of its kind; the runaway's time until its 400 (non-streamed), which the
deadline (`--grammar-compile-timeout`, 10 s by default) bounds.
"""

from __future__ import annotations

import argparse
import itertools
import os
import socket
import statistics
import subprocess
import sys
import threading
import time

import httpx
from rich.console import Console
from rich.table import Table

# 8 strings of at most 200,000 characters (under 500 bytes): about 3.6 s of xgrammar each on a quiet 2-core
# EPYC, so most of a minute in all. One alone ({"type": "string", "maxLength": 200000}) compiles in 3.6 s,
# within the default deadline: not a runaway here.
RUNAWAY = {"type": "object", "properties": {f"p{i}": {"type": "string", "maxLength": 200000 + i} for i in range(8)},
           "required": [f"p{i}" for i in range(8)]}
ASK = [{"role": "user", "content": "Tell me about the sea."}]
BODY: dict = {"messages": ASK}  # and the served model's name, once known
_fresh = itertools.count()


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(timeout: float | None, threads: int | None) -> tuple[subprocess.Popen, str]:
    port = _port()
    argv = [sys.executable, "-m", "ruvllm.cli.main", "serve", "--port", str(port), "--num-blocks", "256",
            *(["--threads", str(threads)] if threads is not None else []),
            *(["--grammar-compile-timeout", str(timeout)] if timeout is not None else [])]
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    while True:
        if proc.poll() is not None:
            raise SystemExit(f"serve exited with {proc.returncode}: {proc.stderr.read().strip()}")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            time.sleep(0.05)


def timed(client: httpx.Client, body: dict) -> tuple[float, httpx.Response]:
    started = time.monotonic()
    r = client.post("/v1/chat/completions", json={**BODY, **body})
    return time.monotonic() - started, r


def plain(client: httpx.Client, tokens: int) -> float:
    s, r = timed(client, {"max_tokens": tokens, "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == tokens, r.text
    return s


def structured(client: httpx.Client, new: bool) -> float:
    tag = f"-{next(_fresh)}" if new else ""
    s, r = timed(client, {"max_tokens": 8, "temperature": 0, "guided_choice": [f"yes{tag}", f"no{tag}"]})
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] in (f"yes{tag}", f"no{tag}"), r.text
    return s


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3, help="quiet phase then runaway phase, this many times")
    ap.add_argument("--quiet-pairs", type=int, default=6, help="plain + cached structured pairs per quiet phase")
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--grammar-compile-timeout", type=float, default=None, help="default: the server's (10 s)")
    ap.add_argument("--threads", type=int, default=None, help="ruvllm serve --threads (default: the server's)")
    args = ap.parse_args()
    console = Console()
    with console.status("ruvllm serve (embedded default model)"):
        proc, url = start(args.grammar_compile_timeout, args.threads)
    load = [os.getloadavg()[0]]
    lat: dict[tuple[str, str], list[float]] = {}
    runaway: list[tuple[float, int, str]] = []

    def note(kind: str, phase: str, s: float) -> None:
        lat.setdefault((kind, phase), []).append(s)

    try:
        model = httpx.get(url + "/v1/models").json()["data"][0]["id"]
        BODY["model"] = model
        with httpx.Client(base_url=url, timeout=300) as client:
            plain(client, args.tokens)
            structured(client, new=False)  # the compile child is up and the cached choice compiled
            for rnd in range(args.rounds):
                with console.status(f"round {rnd + 1}/{args.rounds}: quiet"):
                    for _ in range(args.quiet_pairs):
                        note("plain", "quiet", plain(client, args.tokens))
                        note("structured, cached", "quiet", structured(client, new=False))
                    note("structured, new", "quiet", structured(client, new=True))
                with console.status(f"round {rnd + 1}/{args.rounds}: beside a runaway compile"):
                    done = threading.Event()

                    def run_away() -> None:
                        with httpx.Client(base_url=url, timeout=300) as own:
                            s, r = timed(own, {"max_tokens": 4, "response_format": {
                                "type": "json_schema", "json_schema": {"name": "x", "schema": RUNAWAY}}})
                        runaway.append((s, r.status_code, r.json()["error"]["message"] if r.status_code != 200
                                        else "200"))
                        done.set()

                    def new_one() -> None:
                        with httpx.Client(base_url=url, timeout=300) as own:
                            note("structured, new", "beside a runaway", structured(own, new=True))

                    threads = [threading.Thread(target=run_away)]
                    threads[0].start()
                    time.sleep(0.3)  # the runaway is compiling
                    threads.append(threading.Thread(target=new_one))
                    threads[1].start()
                    while not done.is_set():
                        note("plain", "beside a runaway", plain(client, args.tokens))
                        if done.is_set():
                            break
                        note("structured, cached", "beside a runaway", structured(client, new=False))
                    for t in threads:
                        t.join()
    finally:
        load.append(os.getloadavg()[0])
        proc.terminate()
        proc.wait(timeout=60)

    def med(kind: str, phase: str) -> str:
        xs = lat.get((kind, phase), [])
        return f"{statistics.median(xs) * 1000:.0f} ms (n={len(xs)})" if xs else "-"

    table = Table(title=f"`ruvllm serve` ({model}): latency of a request, alone and beside a runaway compile "
                        f"({args.rounds} rounds; medians)")
    table.add_column("request")
    table.add_column("quiet", justify="right")
    table.add_column("beside a runaway compile", justify="right")
    for kind, label in (("plain", f"plain, {args.tokens} tokens"),
                        ("structured, cached", "guided_choice, compiled before"),
                        ("structured, new", "guided_choice, new (one compile)")):
        table.add_row(label, med(kind, "quiet"), med(kind, "beside a runaway"))
    console.print(table)
    times = [s for s, _, _ in runaway]
    console.print(f"runaway (8 x maxLength 200000, non-streamed): statuses {sorted({c for _, c, _ in runaway})}; time to "
                  f"its answer: median {statistics.median(times):.2f} s, min {min(times):.2f}, max {max(times):.2f} "
                  f"(deadline {args.grammar_compile_timeout or 10:g} s)")
    console.print(f"its message: {runaway[-1][2]}")
    console.print(f"machine load (1-minute average) at the start and the end: {load[0]:.1f}, {load[1]:.1f} "
                  f"on {os.cpu_count()} CPUs")


if __name__ == "__main__":
    main()
