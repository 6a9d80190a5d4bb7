"""ruvllm against llama.cpp at a realistic model size (issue 34): one random-weight GGUF of a real
architecture's shape (benchmarks/random_gguf.py), run by both engines.

- offline: decode (tg, one stream) and prefill (pp, one prompt) against `llama-bench`, as
  benchmarks/vs_llama_bench.py measures them (our pp N: an N-token prompt's time to first token with
  prefix caching off; our tg N: N tokens after a 1-token prompt, tokens after the first over the
  time after the first);
- served: N streaming clients (`--prompt-len`-token prompts, `--gen-len` tokens each, ignore_eos)
  against `llama-server` on the same file, as benchmarks/serve_load.py loads them.

Each side is measured once per round, the engines alternating, for --rounds rounds; the table gives
medians and our rate over llama.cpp's taken within each round (median and range), so that a noisy
neighbour on a shared machine slows both sides of a round alike. The 1-minute load average is
sampled throughout and printed with the table: figures taken under load say so.

llama.cpp's binaries: $LLAMA_BENCH and $LLAMA_SERVER, else $LLAMA_CPP_BIN/<name>, else where
../shared/tools/build-llama-cpp.sh puts them (~/.cache/llama-cpp-peer/llama.cpp/build/bin), else
$PATH. Missing ones are named and that side is left out.

    .venv/bin/python benchmarks/vs_llama_realistic.py --shape smollm2-1.7b --body q4_0 --rounds 3 --clients 1 32
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import threading
from datetime import datetime, timezone
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script: `benchmarks.` imports

from benchmarks import serve_load  # noqa: E402
from benchmarks.random_gguf import BODIES, SHAPES, random_gguf  # noqa: E402

PEER_BIN = Path.home() / ".cache" / "llama-cpp-peer" / "llama.cpp" / "build" / "bin"
_ENV = {"llama-bench": "LLAMA_BENCH", "llama-server": "LLAMA_SERVER"}
# CPU flags that decide which matmul kernels either engine can run.
_KERNEL_FLAGS = ("avx2", "fma", "f16c", "avx_vnni", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16",
                 "amx_tile", "amx_int8", "amx_bf16")


def find_llama_binary(name: str) -> str | None:
    """A llama.cpp binary by name (llama-bench, llama-server): see the module doc for the order."""
    candidates = [os.environ.get(_ENV.get(name, ""), "")]
    if os.environ.get("LLAMA_CPP_BIN"):
        candidates.append(str(Path(os.environ["LLAMA_CPP_BIN"]) / name))
    candidates += [str(PEER_BIN / name), shutil.which(name) or ""]
    return next((c for c in candidates if c and os.access(c, os.X_OK) and Path(c).is_file()), None)


def machine() -> str:
    """CPU model, cores and the kernel-relevant flags, from /proc/cpuinfo (Linux)."""
    model, flags = platform.processor() or "unknown CPU", set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name":
                model = value.strip()
            elif key.strip() == "flags":
                flags = set(value.split())
    except OSError:
        pass
    have = [f for f in _KERNEL_FLAGS if f in flags]
    return f"{model}, {os.cpu_count()} cores; {' '.join(have) or 'no AVX2'}"


class LoadSampler:
    """The 1-minute load average every few seconds, in a thread, while the benchmark runs."""

    def __init__(self, every: float = 5.0) -> None:
        self.samples: list[float] = [os.getloadavg()[0]]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(every,), daemon=True)

    def _run(self, every: float) -> None:
        while not self._stop.wait(every):
            self.samples.append(os.getloadavg()[0])

    def __enter__(self) -> LoadSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def summary(self) -> str:
        s = self.samples
        return f"load average (1 min) min {min(s):.1f} / median {statistics.median(s):.1f} / max {max(s):.1f}"


# -- offline: decode and prefill -------------------------------------------------------------------


def ruvllm_offline(llm, pp: int, tg: int, seed: int) -> tuple[float, float]:
    """(pp tok/s, tg tok/s), one measurement each (the rounds repeat them)."""
    import torch

    from benchmarks.vs_llama_bench import decode_rate, prefill_rate

    return prefill_rate(llm, pp, torch.Generator().manual_seed(seed)), decode_rate(llm, tg, f"tg{seed}")


def offline_rounds(path: Path, args: argparse.Namespace, bench: str | None, console) -> tuple[list, list, dict]:
    from ruvllm import LLM, SamplingParams
    from benchmarks.vs_llama_bench import bytes_per_token, copy_bandwidth, llama_bench_rates

    with console.status("copy bandwidth"):
        bandwidth = copy_bandwidth()
    with console.status(f"loading {path.name} in ruvllm"):
        llm = LLM(str(path), num_threads=args.threads, enable_prefix_caching=False,
                  max_num_batched_tokens=max(512, args.pp), num_blocks=-(-(args.pp + args.tg + 16) // 16) + 8)
    with console.status("ruvllm warm-up"):
        llm.generate([[1] * 32], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    ours, theirs = [], []

    def peer(rnd: int) -> None:
        if bench:
            with console.status(f"llama-bench pp{args.pp} tg{args.tg}, round {rnd + 1}/{args.rounds}"):
                theirs.append(llama_bench_rates(bench, str(path), args.pp, args.tg, args.threads, args.repetitions))

    def own(rnd: int) -> None:
        with console.status(f"ruvllm pp{args.pp} tg{args.tg}, round {rnd + 1}/{args.rounds}"):
            ours.append(tuple(statistics.median(x) for x in zip(
                *(ruvllm_offline(llm, args.pp, args.tg, seed=rnd * 100 + i) for i in range(args.repetitions)))))

    for rnd in range(args.rounds):
        # The engines take turns, the first of a round alternating: a drift in the host's speed then
        # touches both sides alike.
        for side in ((peer, own) if rnd % 2 == 0 else (own, peer)):
            side(rnd)
        console.print(f"round {rnd + 1}: ruvllm pp {ours[-1][0]:.1f} tg {ours[-1][1]:.2f} tok/s"
                      + (f"; llama-bench pp {theirs[-1][0]:.1f} tg {theirs[-1][1]:.2f}" if bench else ""))
    # The engine goes when this returns (the caller collects it): the servers then load their own.
    return ours, theirs, {"bandwidth": bandwidth, "bytes_per_token": bytes_per_token(llm), "dtype": str(llm.info.dtype)}


# -- served: N clients ------------------------------------------------------------------------------


def start_llama_server(binary: str, path: Path, clients: int, ctx_per_client: int, threads: int):
    """llama-server with one slot per client, each with the context a request needs (not 512 per
    slot as serve_load starts it: 32 slots of a 1.7B model would hold 3 GB of KV for nothing)."""
    port = serve_load._free_port()
    proc = subprocess.Popen([binary, "-m", str(path), "--port", str(port), "--parallel", str(clients),
                             "-c", str(ctx_per_client * clients), "-t", str(threads), "--no-webui"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    serve_load._wait_up(url, proc, timeout=600)
    return proc, url


def kv_gib(shape_key: str, tokens: int) -> float:
    """KV memory for `tokens` tokens at fp32 (the widest our CPU cache uses), with a margin."""
    s = SHAPES[shape_key]
    per_token = s.layers * 2 * s.kv_heads * s.head_dim * 4
    return round(max(0.25, tokens * per_token * 1.25 / 2**30), 2)


def served_rounds(path: Path, args: argparse.Namespace, server: str | None, clients: int, console) -> list[dict]:
    ctx = -(-(args.prompt_len + args.gen_len + 32) // 256) * 256
    texts = serve_load.prompts(clients * args.rounds, args.prompt_len, str(path))
    extra = ["--threads", str(args.threads), "--kv-cache-gib", str(kv_gib(args.shape, clients * ctx))]
    procs, targets, rows = [], [], []
    try:
        with console.status(f"starting ruvllm serve for {clients} clients"):
            proc, url = serve_load.start_ruvllm(clients, extra, str(path), "random")
        procs.append(proc)
        targets.append(("ruvllm", url))
        if server:
            with console.status(f"starting llama-server for {clients} clients"):
                proc, url = start_llama_server(server, path, clients, ctx, args.threads)
            procs.append(proc)
            targets.append(("llama-server", url))
        for rnd in range(args.rounds):
            # Alternate which server goes first, so neither always follows the other's warm caches.
            for name, url in (targets if rnd % 2 == 0 else targets[::-1]):
                batch = texts[rnd * clients:(rnd + 1) * clients]
                with console.status(f"{name}: {clients} clients, round {rnd + 1}/{args.rounds}"):
                    row = asyncio.run(serve_load.run_load(url, "random", batch, clients, args.gen_len))
                row.update(server=name, round=rnd)
                rows.append(row)
                console.print(f"round {rnd + 1}: {name}, {clients} client(s): {row['output_tok_s']:.2f} tok/s, "
                              f"TTFT p50 {row['ttft_p50']:.2f} s")
    finally:
        for proc in procs:
            proc.terminate()
            proc.wait(timeout=60)
    return rows


# -- the table ---------------------------------------------------------------------------------------


def ratio_cells(ours: list[float], theirs: list[float]) -> tuple[str, str]:
    if not theirs:
        return "-", "-"
    r = [a / b for a, b in zip(ours, theirs)]
    return f"{statistics.median(r):.2f}x", f"{min(r):.2f}-{max(r):.2f}x"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="smollm2-1.7b")
    ap.add_argument("--body", choices=sorted(BODIES), default="q4_0")
    ap.add_argument("--seed", type=int, default=0, help="the random weights' seed")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--repetitions", type=int, default=1, help="offline measurements per engine and round")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--pp", type=int, default=512)
    ap.add_argument("--tg", type=int, default=128)
    ap.add_argument("--clients", type=int, nargs="*", default=[1, 32], help="served levels (none: skip serving)")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--gen-len", type=int, default=64)
    ap.add_argument("--no-offline", action="store_true", help="skip decode / prefill")
    ap.add_argument("--json", type=Path, help="also write every measurement here")
    args = ap.parse_args()

    from rich.console import Console
    from rich.table import Table

    console = Console(width=max(Console().width, 150))  # the table's notes need the room
    bench, server = find_llama_binary("llama-bench"), find_llama_binary("llama-server")
    for name, found in (("llama-bench", bench), ("llama-server", server)):
        if not found:
            console.print(f"[yellow]{name} not found[/] ($" + _ENV[name] + f", $LLAMA_CPP_BIN, {PEER_BIN}, $PATH): "
                          "its side is left out; build it with ../shared/tools/build-llama-cpp.sh")
    path = random_gguf(args.shape, args.body, seed=args.seed)
    started = datetime.now(timezone.utc)
    result: dict = {"file": str(path), "machine": machine(), "date": started.isoformat(timespec="seconds"),
                    "args": {k: str(v) for k, v in vars(args).items()}}
    with LoadSampler() as load:
        if not args.no_offline:
            ours, theirs, extra = offline_rounds(path, args, bench, console)
            result["offline"] = {"ruvllm": ours, "llama-bench": theirs, **extra}
            gc.collect()
        result["served"] = [row for n in args.clients for row in served_rounds(path, args, server, n, console)]
    result["load"] = load.samples

    s = SHAPES[args.shape]
    table = Table(title=f"{s.name} shape, random weights, {args.body.upper()} body, Q8_0 table ({path.name}); "
                        f"{args.threads} threads; medians of {args.rounds} rounds\n{result['machine']}\n"
                        f"{started:%Y-%m-%d %H:%M} UTC; {load.summary()}")
    for col in ("work", "ruvllm", "llama.cpp", "ratio", "ratio range", "note"):
        table.add_column(col, justify="right")
    med = statistics.median
    if "offline" in result:
        off = result["offline"]
        ours, theirs = off["ruvllm"], off["llama-bench"]
        tg = med(r[1] for r in ours)
        roof = f"{off['bytes_per_token'] / 2**20:.0f} MiB/token: {off['bytes_per_token'] * tg / off['bandwidth']:.0%} " \
               f"of {off['bandwidth'] / 1e9:.1f} GB/s copy"
        for i, label, note in ((1, f"decode, 1 stream (tg{args.tg}) tok/s", roof),
                               (0, f"prefill (pp{args.pp}) tok/s", "")):
            a, b = [r[i] for r in ours], [r[i] for r in theirs]
            table.add_row(label, f"{med(a):.2f}", f"{med(b):.2f}" if b else "-", *ratio_cells(a, b), note)
    for n in args.clients:
        rows = [r for r in result["served"] if r["concurrency"] == n]
        a = [r for r in rows if r["server"] == "ruvllm"]
        b = {r["round"]: r for r in rows if r["server"] == "llama-server"}
        pairs = [(r, b[r["round"]]) for r in a if r["round"] in b]
        label = f"server, {n} client{'s' if n > 1 else ''} ({args.prompt_len} in, {args.gen_len} out) tok/s"
        ttft = f"TTFT p50 {med(r['ttft_p50'] for r in a):.2f} s" + (
            f" vs {med(r['ttft_p50'] for r in b.values()):.2f} s" if b else "")
        table.add_row(label, f"{med(r['output_tok_s'] for r in a):.2f}",
                      f"{med(r['output_tok_s'] for r in b.values()):.2f}" if b else "-",
                      *ratio_cells([p[0]["output_tok_s"] for p in pairs], [p[1]["output_tok_s"] for p in pairs]),
                      ttft)
    console.print(table)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
