"""The two-tier KV cache per KV dtype: perplexity, capacity under one memory budget, decode speed.

For each --kv-dtypes entry (auto = the compute dtype, int8, int4): perplexity on a text file cut into
--window-token windows, each scored with prompt logprobs in one prefill (every query reads the keys
older than its hot window dequantized, exactly as a decode would: docs/quantization.md), the KV
tokens a --budget-gib pool holds, and with --decode the decode tokens/s at 1 and 32 streams after
--decode-prompt tokens of context (so most of the context is cold).

    .venv/bin/python benchmarks/kv_cache.py ../shared/data/pride-and-prejudice.txt --max-tokens 8192 --kv-hot-tokens 64
    .venv/bin/python benchmarks/kv_cache.py ../shared/data/pride-and-prejudice.txt --decode --streams 1 32
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from ruvllm import LLM, SamplingParams
from ruvllm.messages import CoreRequest


def perplexity(llm: LLM, ids: list[int], window: int) -> tuple[float, list[float]]:
    """Perplexity, and the logprob of every scored token (to compare KV dtypes token by token)."""
    windows = [ids[i:i + window] for i in range(0, len(ids) - 1, window) if len(ids[i:i + window]) > 1]
    outs = llm.generate(windows, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0))
    lps = [out.prompt_logprobs[pos][w[pos]].logprob for w, out in zip(windows, outs) for pos in range(1, len(w))]
    return math.exp(-sum(lps) / len(lps)), lps


def decode_speed(llm: LLM, ids: list[int], streams: int, prompt_len: int, gen: int) -> tuple[float, float]:
    """Decode tokens/s of `streams` sequences generating together after their prompts are in, from
    the median and from the fastest decode step (on a shared machine the fastest step is the
    steadiest figure of what the code itself costs)."""
    core = llm.core
    params = SamplingParams(temperature=0, max_tokens=gen, ignore_eos=True)
    for i in range(streams):
        start = (i * 7919) % max(1, len(ids) - prompt_len)
        core.add_request(CoreRequest(f"d{i}", ids[start:start + prompt_len], params, llm.eos_token_ids))
    started: set[str] = set()
    while len(started) < streams:  # every prompt prefilled and its first token out
        started.update(out.request_id for out in core.step() if out.new_token_ids)
    times = []
    while core.has_unfinished:
        t0 = time.perf_counter()
        n = sum(len(out.new_token_ids) for out in core.step())
        times.append((time.perf_counter() - t0) / n)
    times.sort()
    return 1 / times[len(times) // 2], 1 / times[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("path", type=Path)
    ap.add_argument("--model", default=None, help="default: the embedded model")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--kv-dtypes", nargs="+", default=["auto", "int8", "int4"])
    ap.add_argument("--kv-hot-tokens", type=int, default=64)
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--max-tokens", type=int, default=8192, help="tokens of the text to score (0: no perplexity)")
    ap.add_argument("--budget-gib", type=float, default=1.0, help="KV memory budget for the capacity column")
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--max-num-batched-tokens", type=int, default=512,
                    help="the engine's step budget (the hot tier holds one step's new tokens)")
    ap.add_argument("--decode", action="store_true", help="also measure decode tokens/s")
    ap.add_argument("--streams", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--decode-prompt", type=int, default=448, help="context tokens before decoding")
    ap.add_argument("--decode-gen", type=int, default=64)
    args = ap.parse_args()
    text = args.path.read_text(encoding="utf-8")
    rows = []
    for kv in args.kv_dtypes:
        llm = LLM(args.model, dtype=args.dtype, kv_cache_dtype=kv, kv_hot_tokens=args.kv_hot_tokens,
                  kv_cache_memory_bytes=int(args.budget_gib * 2**30), max_num_batched_tokens=args.max_num_batched_tokens,
                  max_num_seqs=args.max_num_seqs)
        info = llm.info
        ids = llm.tokenizer.encode(text, add_special_tokens=False)
        row = {"kv": kv, "tokens": info.num_blocks * info.block_size,
               "hot": info.num_hot_blocks, "cold": info.num_cold_blocks}
        if args.max_tokens:
            t0 = time.perf_counter()
            row["ppl"], row["lps"] = perplexity(llm, ids[:args.max_tokens], args.window)
            row["seconds"] = time.perf_counter() - t0
        if args.decode:
            for n in args.streams:
                row[f"tok/s@{n}"] = decode_speed(llm, ids, n, args.decode_prompt, args.decode_gen)
        rows.append(row)
        del llm

    base = rows[0]
    table = Table(title=f"KV cache dtypes: {args.path.name}, {args.window}-token windows, hot window "
                        f"{args.kv_hot_tokens} tokens, {args.budget_gib:g} GiB budget")
    cols = ["kv dtype", "hot + cold blocks", f"KV tokens in {args.budget_gib:g} GiB", "vs first"]
    if args.max_tokens:
        cols += ["perplexity", "vs first", "mean / max |Δ logprob| vs first", "tokens scored", "seconds"]
    if args.decode:
        cols += [f"decode tok/s @{n} (median / best step)" for n in args.streams]
    for c in cols:
        table.add_column(c, justify="right")
    for r in rows:
        cells = [r["kv"], f"{r['hot']} + {r['cold']}", f"{r['tokens']:,}", f"{r['tokens'] / base['tokens']:.2f}x"]
        if args.max_tokens:
            dl = [abs(a - b) for a, b in zip(r["lps"], base["lps"])]
            cells += [f"{r['ppl']:.4f}", f"{100 * (r['ppl'] / base['ppl'] - 1):+.2f}%",
                      f"{sum(dl) / len(dl):.4f} / {max(dl):.3f}", str(len(dl)), f"{r['seconds']:.0f}"]
        if args.decode:
            cells += ["{:.1f} / {:.1f}".format(*r[f"tok/s@{n}"]) for n in args.streams]
        table.add_row(*cells)
    Console().print(table)


if __name__ == "__main__":
    main()
