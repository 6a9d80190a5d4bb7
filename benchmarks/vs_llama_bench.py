"""ruvllm against llama.cpp's `llama-bench` on the same GGUF file, in one run: pp (prefill of one
prompt) and tg (one stream generating), as llama-bench defines them, with ratios, and the decode
rate as a share of the machine's memory bandwidth (weight bytes read per token x tok/s, against the
copy bandwidth measured here).

ruvllm's side: pp N is one N-token prompt (prefix caching off, so nothing is reused) with
max_tokens=1, its time to first token; tg N is one stream's N generated tokens after a 1-token
prompt, tokens after the first over the time after the first. Median of --repetitions, after a
warm-up. llama-bench runs with -t --threads, -r --repetitions. With --rounds N the engines alternate N
times and the table gives medians, the ratios taken within each round (a shared machine's noise
then slows both sides of a round alike).

    .venv/bin/python benchmarks/vs_llama_bench.py --llama-bench ~/.cache/llama-cpp-peer/llama.cpp/build/bin/llama-bench --rounds 5
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import time

import torch
from rich.console import Console
from rich.table import Table

from ruvllm import LLM, SamplingParams
from ruvllm.loader import resolve_model
from ruvllm.messages import CoreRequest


def copy_bandwidth(gib: float = 1.0, repetitions: int = 5) -> float:
    """Bytes a second that a large copy moves (read + write), the best of a few: the roofline's rate."""
    src = torch.ones(int(gib * 2**30) // 4)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(repetitions):
        t = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t)
    return 2 * src.numel() * 4 / best


def bytes_per_token(llm: LLM) -> int:
    """Weight bytes one decode step reads: every linear's weights (packed buffers or dense), the LM
    head included (a tied dense head reads the embedding table); embedding lookups read one row."""
    model, total = llm.model, 0
    for name, module in model.named_modules():
        if name.endswith("_proj") or name == "lm_head":
            total += sum(t.numel() * t.element_size() for t in [*module.parameters(), *module.buffers()]
                         if t.dim() >= 1 and t.numel() > module.out_features)
    if not hasattr(model, "lm_head"):
        total += model.embed_tokens.weight.numel() * model.embed_tokens.weight.element_size()
    return total


def prefill_rate(llm: LLM, pp: int, gen: torch.Generator) -> float:
    """Prompt tokens a second over one prompt of `pp` random ids (one output token)."""
    ids = torch.randint(1000, llm.model.cfg.vocab_size - 1000, (pp,), generator=gen).tolist()
    t = time.perf_counter()
    llm.generate([ids], SamplingParams(temperature=0, max_tokens=1))
    return pp / (time.perf_counter() - t)


def decode_rate(llm: LLM, tg: int, request_id: str) -> float:
    """Output tokens a second of one stream, from its first token to its last (llama-bench's tg)."""
    core = llm.core
    core.add_request(CoreRequest(request_id, [1], SamplingParams(temperature=0, max_tokens=tg, ignore_eos=True)))
    first, n = None, 0
    while core.has_unfinished:
        for out in core.step():
            n += len(out.new_token_ids)
            first = first or time.perf_counter()
    assert first is not None and n == tg, (n, tg)
    return (tg - 1) / (time.perf_counter() - first)


def ruvllm_rates(llm: LLM, pp: int, tg: int, repetitions: int) -> tuple[float, float]:
    gen = torch.Generator().manual_seed(0)
    runs = iter(range(1_000_000))
    prefill_rate(llm, pp, gen), decode_rate(llm, tg, f"tg{next(runs)}")  # warm-up
    return (statistics.median(prefill_rate(llm, pp, gen) for _ in range(repetitions)),
            statistics.median(decode_rate(llm, tg, f"tg{next(runs)}") for _ in range(repetitions)))


def llama_bench_rates(binary: str, gguf: str, pp: int, tg: int, threads: int, repetitions: int) -> tuple[float, float]:
    out = subprocess.run([binary, "-m", gguf, "-t", str(threads), "-p", str(pp), "-n", str(tg),
                          "-r", str(repetitions), "-o", "json"], capture_output=True, text=True, check=True).stdout
    rows = json.loads(out)
    rate = {("pp" if r["n_gen"] == 0 else "tg"): r["avg_ts"] for r in rows}
    return rate["pp"], rate["tg"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="a GGUF file (default: the embedded model)")
    ap.add_argument("--llama-bench", default=None, help="path to llama-bench (else only ruvllm's side)")
    ap.add_argument("--quantization", nargs="+", default=["auto"], help="ruvllm precisions, one row each")
    ap.add_argument("--pp", type=int, default=512)
    ap.add_argument("--tg", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repetitions", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=1, help="alternate the engines this many times (medians)")
    args = ap.parse_args()

    gguf = str(resolve_model(args.model).path)
    bandwidth = copy_bandwidth()
    llms = {method: LLM(args.model, quantization=method, num_threads=args.threads, enable_prefix_caching=False,
                        max_num_batched_tokens=max(2048, args.pp), num_blocks=256) for method in args.quantization}
    # Rounds alternate the engines, so that a noisy neighbour on a shared machine slows both sides of
    # a round alike; ratios are taken within each round, and their median reported.
    runs: dict[str, list[tuple[float, float]]] = {}
    for _ in range(args.rounds):
        if args.llama_bench:
            runs.setdefault("llama.cpp (llama-bench)", []).append(
                llama_bench_rates(args.llama_bench, gguf, args.pp, args.tg, args.threads, args.repetitions))
        for method, llm in llms.items():
            runs.setdefault(f"ruvllm -q {method} ({llm.info.dtype})", []).append(
                ruvllm_rates(llm, args.pp, args.tg, args.repetitions))
    nbytes = {f"ruvllm -q {m} ({llm.info.dtype})": bytes_per_token(llm) for m, llm in llms.items()}

    table = Table(title=f"pp{args.pp} / tg{args.tg}, {args.threads} threads, median of {args.rounds} round(s); "
                        f"copy bandwidth {bandwidth / 1e9:.1f} GB/s (read + write)")
    for col in ("engine", f"pp{args.pp} tok/s", f"tg{args.tg} tok/s", "pp vs llama.cpp", "tg vs llama.cpp",
                "tg ratio range", "bytes / token", "tg roofline share"):
        table.add_column(col, justify="right")
    ref = runs.get("llama.cpp (llama-bench)")
    med = statistics.median
    for name, rates in runs.items():
        pp, tg = med(r[0] for r in rates), med(r[1] for r in rates)
        ratios = [(r[0] / b[0], r[1] / b[1]) for r, b in zip(rates, ref)] if ref else []
        n = nbytes.get(name)
        table.add_row(name, f"{pp:.1f}", f"{tg:.1f}",
                      f"{med(x[0] for x in ratios):.2f}x" if ratios else "-",
                      f"{med(x[1] for x in ratios):.2f}x" if ratios else "-",
                      f"{min(x[1] for x in ratios):.2f}-{max(x[1] for x in ratios):.2f}x" if ratios else "-",
                      f"{n / 2**20:.1f} MiB" if n else "-",
                      f"{n * tg / bandwidth:.0%}" if n else "-")
    Console().print(table)


if __name__ == "__main__":
    main()
