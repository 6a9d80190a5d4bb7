"""What embeddings cost generation when both share the scheduler (issue 35, part 4).

Two arms over the same engine (the core in its own process, as `ruvllm serve` runs it):
1. generation alone: --streams streams, each generating --max-tokens tokens (ignore_eos) and starting
   again at once, so --streams sequences decode all the time; tokens/s counted over --seconds;
2. the same, with embedding requests arriving at --rate a second (evenly spaced), each one of the
   novel's passages of --words words (last-token pooling unless --pooling mean).

The goal: generation's tokens/s in arm 2 at least 90% of arm 1's. Each arm has --warmup seconds
before its window opens; with several --rate values there is one mixed arm per rate, and --rounds
repeats (alone, each mixed arm) in turn, medians reported. The last column divides the generated
tokens a second lost by the embedded prompt tokens a second: what one embedded token costs generation,
in generated tokens, which tells the embeddings' own compute from any cost of scheduling them.
Prints a table (and records nothing: copy it into docs/benchmarks.md).

    .venv/bin/python benchmarks/embeddings_load.py --seconds 30 --threads 2 --rate 1 3 10 --rounds 3

On a machine shared with other jobs, give --threads no more than the cores that are really free:
an OpenMP pool larger than that spins at its barriers and a step can take ten times as long, in
either arm, at random (measured here under a load of 5 to 9: 8 streams alone made 0.8 tok/s with
2 threads and 54 with --threads 1).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from ruvllm import AsyncEngine, EngineConfig, SamplingParams
from ruvllm.outputs import OutputKind

BOOK = Path(__file__).resolve().parents[2] / "shared" / "data" / "pride-and-prejudice.txt"


def passages(n: int, words: int) -> list[str]:
    if BOOK.exists():
        text = BOOK.read_text(encoding="utf-8").split()[2000:]
    else:
        text = ("It is a truth universally acknowledged that a single man in possession of a good fortune "
                "must be in want of a wife ").split() * 400
    return [" ".join(text[(i * 53) % (len(text) - words):][:words]) for i in range(n)]


async def arm(engine: AsyncEngine, args: argparse.Namespace, rate: float, tag: str) -> dict[str, float]:
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    prompts = passages(args.streams, 24)
    texts = passages(4096, args.words)
    window: list[float] = []  # [start, end], set once warm
    tokens = 0
    latencies: list[float] = []
    embedded = 0  # prompt tokens of the embeddings finished inside the window
    stop = asyncio.Event()

    async def stream(i: int) -> None:
        nonlocal tokens
        k = 0
        while not stop.is_set():
            async for out in engine.generate(prompts[i], params, f"g{i}-{k}-{rate}-{tag}", output_kind=OutputKind.DELTA):
                if window and window[0] <= time.monotonic() <= window[1]:
                    tokens += sum(len(c.token_ids) for c in out.outputs)
                if stop.is_set():
                    break
            k += 1

    async def embed_one(j: int) -> None:
        nonlocal embedded
        t = time.monotonic()
        out = await engine.embed(texts[j % len(texts)], f"e{j}-{rate}-{tag}", pooling=args.pooling)
        if window and window[0] <= t and time.monotonic() <= window[1]:
            latencies.append(time.monotonic() - t)
            embedded += len(out.prompt_token_ids)

    async def arrivals() -> None:
        j, pending = 0, set()
        start = time.monotonic()
        while not stop.is_set():
            task = asyncio.create_task(embed_one(j))
            pending.add(task)
            task.add_done_callback(pending.discard)
            j += 1
            try:  # until the next arrival, or the end of the arm
                await asyncio.wait_for(stop.wait(), max(0.0, start + j / rate - time.monotonic()))
            except asyncio.TimeoutError:
                pass
        await asyncio.gather(*pending, return_exceptions=True)

    tasks = [asyncio.create_task(stream(i)) for i in range(args.streams)]
    if rate > 0:
        tasks.append(asyncio.create_task(arrivals()))
    await asyncio.sleep(args.warmup)
    t0 = time.monotonic()
    window[:] = [t0, t0 + args.seconds]
    await asyncio.sleep(args.seconds)
    stop.set()
    await asyncio.gather(*tasks)
    result = {"tok_s": tokens / args.seconds, "embeddings": len(latencies), "embedded_s": embedded / args.seconds}
    if latencies:
        latencies.sort()
        result["p50"] = statistics.median(latencies)
        result["p95"] = latencies[min(len(latencies) - 1, int(0.95 * len(latencies)))]
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="a path or name (default: the embedded default model)")
    ap.add_argument("--streams", type=int, default=32)
    ap.add_argument("--rate", type=float, nargs="+", default=[10.0],
                    help="embedding requests a second in the mixed arms (several: one mixed arm each)")
    ap.add_argument("--rounds", type=int, default=1, help="rounds of (generation alone, each mixed arm), alternated")
    ap.add_argument("--words", type=int, default=40, help="words per embedded passage (~1.3 tokens a word)")
    ap.add_argument("--pooling", choices=("last", "mean"), default=None)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--seconds", type=float, default=45.0, help="each arm's measured window")
    ap.add_argument("--warmup", type=float, default=10.0)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    engine = AsyncEngine.launch(EngineConfig(model=args.model, num_threads=args.threads))
    runs: dict[float, list[dict[str, float]]] = {r: [] for r in [0.0, *args.rate]}
    try:
        for k in range(args.rounds):
            for rate in runs:
                runs[rate].append(asyncio.run(arm(engine, args, rate, str(k))))
    finally:
        engine.shutdown()

    def med(rate: float, key: str) -> float:
        values = [r[key] for r in runs[rate] if key in r]
        return statistics.median(values) if values else float("nan")

    table = Table(title=f"{args.streams} generation streams; embeddings of {args.words} words "
                        f"({engine.info.device}, {engine.info.dtype}, pooling {args.pooling or engine.info.pooling}; "
                        f"medians of {args.rounds} alternated rounds; load average {os.getloadavg()[0]:.1f})")
    for col in ("arm", "generation tok/s", "embedded tokens/s", "embedding p50 (s)", "embedding p95 (s)",
                "generation cost", "tokens lost per embedded token"):
        table.add_column(col, justify="right")
    base = med(0.0, "tok_s")
    table.add_row("generation alone", f"{base:.1f}", "-", "-", "-", "-", "-")
    for rate in args.rate:
        tok, emb = med(rate, "tok_s"), med(rate, "embedded_s")
        cost = 1 - tok / base if base else float("nan")
        lost = (base - tok) / emb if emb else float("nan")
        table.add_row(f"+ embeddings {rate:g}/s", f"{tok:.1f}", f"{emb:.1f}", f"{med(rate, 'p50'):.3f}",
                      f"{med(rate, 'p95'):.3f}", f"{cost:.1%}", f"{lost:.2f}")
    Console().print(table)
    print("tokens lost per embedded token: generated tokens/s lost over embedded prompt tokens/s; below 1, an "
          "embedded token costs generation less than a generated one (a prefill row is cheaper than a decode row).")


if __name__ == "__main__":
    main()
