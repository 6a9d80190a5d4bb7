"""Data-parallel replicas (docs/scaling.md): aggregate throughput against one engine, and the prefix
routing's cache hit rate on multi-turn chats against round-robin and a single replica.

    # 32 streams: 2 replicas x 1 thread against 1 replica x 1 thread and 1 replica x 2 threads
    COLUMNS=200 .venv/bin/python benchmarks/data_parallel.py scaling --concurrency 32 --rounds 3
    # 50 multi-turn chats on 2 replicas: prefix routing, least-loaded, round-robin; 1 replica for reference
    COLUMNS=200 .venv/bin/python benchmarks/data_parallel.py routing --chats 50 --turns 4

Both drive AsyncEngine, the front `ruvllm serve` runs (tokenizer, detokenizer, router in this process;
each engine core in a process of its own), on the embedded default model.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from ruvllm import AsyncEngine, EngineConfig, SamplingParams
from ruvllm.config import CacheConfig
from ruvllm.engine.data_parallel import DataParallelConfig
from ruvllm.engine.router import RouterConfig
from ruvllm.outputs import OutputKind

BOOK = Path(__file__).resolve().parents[2] / "shared" / "data" / "pride-and-prejudice.txt"


def _words() -> list[str]:
    if BOOK.exists():
        return BOOK.read_text(encoding="utf-8").split()[2000:]
    return ("It is a truth universally acknowledged that a single man in possession of a good fortune "
            "must be in want of a wife ").split() * 400


def _engine(replicas: int, threads: int, policy: str = "prefix", prefix_caching: bool = True,
            pin: bool = True) -> AsyncEngine:
    config = EngineConfig(num_threads=threads, cache=CacheConfig(enable_prefix_caching=prefix_caching))
    return AsyncEngine.launch(config, DataParallelConfig(replicas, threads, pin_cores=pin, routing=RouterConfig(policy=policy)))


async def _drain(engine: AsyncEngine, prompt: str | list[int], params: SamplingParams, rid: str) -> tuple[str, int, int]:
    text, tokens, cached = "", 0, 0
    async for out in engine.generate(prompt, params, rid, output_kind=OutputKind.FINAL_ONLY):
        text, tokens, cached = out.outputs[0].text, len(out.outputs[0].token_ids), out.num_cached_tokens
    return text, tokens, cached


# --- scaling --------------------------------------------------------------------------------------
def scaling(args: argparse.Namespace, console: Console) -> None:
    words = _words()
    setups = [(1, 1, True), (1, 2, True), (2, 1, True), (2, 1, False)]
    rates: dict[tuple[int, int, bool], list[float]] = {s: [] for s in setups}
    engines = {}
    for replicas, threads, pin in setups:  # all loaded first, then they take turns: one runs at a time
        engines[(replicas, threads, pin)] = _engine(replicas, threads, prefix_caching=False, pin=pin)
    tok = next(iter(engines.values())).tokenizer
    prompts = []
    for i in range(args.concurrency):
        ids = tok.encode(" ".join(words[i * 300:(i + 1) * 300]), add_special_tokens=False)[:args.prompt_len]
        prompts.append(ids)
    params = SamplingParams(temperature=0, max_tokens=args.gen_len, ignore_eos=True)

    async def load(engine: AsyncEngine, tag: str) -> float:
        await _drain(engine, "Warm up.", SamplingParams(max_tokens=4), f"{tag}-warm")
        start = time.perf_counter()
        outs = await asyncio.gather(*(_drain(engine, p, params, f"{tag}-{i}") for i, p in enumerate(prompts)))
        return sum(n for _, n, _ in outs) / (time.perf_counter() - start)

    try:
        for r in range(args.rounds):
            for setup in setups:
                rates[setup].append(asyncio.run(load(engines[setup], f"r{r}-{setup}")))
    finally:
        for engine in engines.values():
            engine.shutdown()
    base = statistics.median(rates[(1, 1, True)])
    two_threads = statistics.median(rates[(1, 2, True)])
    table = Table(title=f"{args.concurrency} streams, prompt {args.prompt_len} tokens, {args.gen_len} generated "
                        f"(greedy, EOS ignored), median of {args.rounds} rounds")
    for col in ("setup", "output tok/s", "range", "vs 1 x 1 thread", "vs 1 x 2 threads"):
        table.add_column(col, justify="right")
    for (replicas, threads, pin), rs in rates.items():
        med = statistics.median(rs)
        pinned = (", each on its own core" if pin else ", not pinned") if replicas > 1 else ""
        table.add_row(f"{replicas} replica{'s' if replicas > 1 else ''} x {threads} thread{'s' if threads > 1 else ''}"
                      f"{pinned}",
                      f"{med:.1f}", f"{min(rs):.1f}-{max(rs):.1f}", f"{med / base:.2f}x", f"{med / two_threads:.2f}x")
    console.print(table)


# --- routing --------------------------------------------------------------------------------------
def routing(args: argparse.Namespace, console: Console) -> None:
    words = _words()
    setups = [("1 replica", 1, "prefix"), ("2 replicas, prefix", 2, "prefix"),
              ("2 replicas, least_loaded", 2, "least_loaded"), ("2 replicas, round_robin", 2, "round_robin")]
    table = Table(title=f"{args.chats} chats x {args.turns} turns, {args.parallel} chats at a time, "
                        f"replies of {args.gen_len} tokens; prefix-cache hit rate over all prompt tokens")
    for col in ("setup", "hit rate", "vs 1 replica", "prompt tokens", "cached tokens", "seconds"):
        table.add_column(col, justify="right")
    base = None
    for name, replicas, policy in setups:
        engine = _engine(replicas, max(1, 2 // replicas), policy)
        try:
            before = engine.stats()
            start = time.perf_counter()
            asyncio.run(_chats(engine, words, args))
            seconds = time.perf_counter() - start
            after = engine.stats()
        finally:
            engine.shutdown()
        queries = after.prefix_queries - before.prefix_queries
        hits = after.prefix_hits - before.prefix_hits
        rate = hits / queries if queries else 0.0
        base = rate if base is None else base
        table.add_row(name, f"{rate:.1%}", f"{rate / base:.2f}" if base else "", f"{queries:,}", f"{hits:,}",
                      f"{seconds:.1f}")
    console.print(table)


async def _chats(engine: AsyncEngine, words: list[str], args: argparse.Namespace) -> None:
    params = SamplingParams(temperature=0, max_tokens=args.gen_len)
    gate = asyncio.Semaphore(args.parallel)

    async def chat(c: int) -> None:
        async with gate:
            history = [{"role": "system", "content": "You are a helpful assistant who answers briefly."}]
            for t in range(args.turns):
                start = (c * args.turns + t) * 40
                question = "Explain this passage: " + " ".join(words[start:start + 30])
                history.append({"role": "user", "content": question})
                ids = engine.tokenizer.apply_chat_template(history, add_generation_prompt=True, tokenize=True)
                if not isinstance(ids, list):  # transformers 5 returns a BatchEncoding
                    ids = list(ids["input_ids"])
                text, _, _ = await _drain(engine, ids, params, f"chat{c}-turn{t}")
                history.append({"role": "assistant", "content": text})

    await asyncio.gather(*(chat(c) for c in range(args.chats)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="what", required=True)
    sc = sub.add_parser("scaling")
    sc.add_argument("--concurrency", type=int, default=32)
    sc.add_argument("--prompt-len", type=int, default=128)
    sc.add_argument("--gen-len", type=int, default=64)
    sc.add_argument("--rounds", type=int, default=3)
    ro = sub.add_parser("routing")
    ro.add_argument("--chats", type=int, default=50)
    ro.add_argument("--turns", type=int, default=4)
    ro.add_argument("--parallel", type=int, default=8, help="chats in flight at once")
    ro.add_argument("--gen-len", type=int, default=24)
    args = ap.parse_args()
    console = Console()
    {"scaling": scaling, "routing": routing}[args.what](args, console)


if __name__ == "__main__":
    main()
