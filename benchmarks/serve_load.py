"""Load test for any OpenAI-compatible server: N concurrent streaming clients.

Every client streams /v1/completions requests (a --prompt-len token prompt cut from a public-domain
novel, exactly --gen-len generated tokens with ignore_eos). Reports aggregate output tokens/s, time to
first token p50/p99 and end-to-end latency, side by side for every server in one run:

    # ruvllm started here on the embedded model, and a llama-server built on this machine:
    .venv/bin/python benchmarks/serve_load.py --start-ruvllm --llama-server ~/llama.cpp/build/bin/llama-server
    # servers already running:
    .venv/bin/python benchmarks/serve_load.py --base-url http://127.0.0.1:8000 --peer-url http://127.0.0.1:8080
    # the server against the same engine offline (LLM.generate, same prompts, same settings):
    .venv/bin/python benchmarks/serve_load.py --start-ruvllm --offline --concurrency 1 32
    # another GGUF for both servers (prompts cut with its tokenizer), e.g. Gemma 3 270M:
    .venv/bin/python benchmarks/serve_load.py --start-ruvllm --llama-server BIN --model-path FILE.gguf --model gemma

With --rounds N every server of a level stays up and they take turns N times; the table gives medians
and our rate against the peer's within each round (its median and range).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parents[1]
BOOK = ROOT.parent / "shared" / "data" / "pride-and-prejudice.txt"
# Not a prefix of any prompt, so the warm-up leaves nothing in the prefix cache to hit.
WARM_UP = "A short warm-up request."


@dataclass
class Result:
    ttft: float
    e2e: float
    tokens: int


def prompts(n: int, prompt_len: int, model_path: str | None = None) -> list[str]:
    """Distinct prompts of ~prompt_len tokens of the model's tokenizer (measured, then cut)."""
    from ruvllm.loader import load_tokenizer, resolve_model
    tok = load_tokenizer(resolve_model(model_path))
    text = BOOK.read_text(encoding="utf-8") if BOOK.exists() else "It was a bright cold day in April. " * 4000
    ids = tok.encode(text[30000:], add_special_tokens=False)
    return [tok.decode(ids[i * prompt_len * 2:i * prompt_len * 2 + prompt_len]) for i in range(n)]


async def one_request(client: httpx.AsyncClient, url: str, model: str, prompt: str, gen_len: int) -> Result:
    body = {"model": model, "prompt": prompt, "max_tokens": gen_len, "temperature": 0, "stream": True,
            "ignore_eos": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    first = None
    chunks = 0
    usage_tokens = None
    async with client.stream("POST", url + "/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            data = json.loads(line[6:])
            if data.get("usage"):
                usage_tokens = data["usage"].get("completion_tokens")
            for choice in data.get("choices") or []:
                if choice.get("text"):
                    chunks += 1
                    if first is None:
                        first = time.perf_counter()
    end = time.perf_counter()
    return Result((first or end) - start, end - start, usage_tokens or chunks)


async def run_load(url: str, model: str, texts: list[str], concurrency: int, gen_len: int) -> dict:
    # The warm-up on a connection of its own: reused by the first measured request, it met llama-server's
    # close of that connection after its stream (httpx: "Server disconnected without sending a response").
    async with httpx.AsyncClient(timeout=httpx.Timeout(3600)) as client:
        await one_request(client, url, model, WARM_UP, 4)
    limits = httpx.Limits(max_connections=concurrency + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(3600), limits=limits) as client:
        start = time.perf_counter()
        results = await asyncio.gather(*(one_request(client, url, model, texts[i], gen_len)
                                         for i in range(concurrency)))
        wall = time.perf_counter() - start
    ttfts = sorted(r.ttft for r in results)
    return {
        "concurrency": concurrency, "output_tok_s": sum(r.tokens for r in results) / wall,
        "ttft_p50": statistics.median(ttfts), "ttft_p99": ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))],
        "e2e_mean": statistics.fmean(r.e2e for r in results), "tokens": sum(r.tokens for r in results),
    }


def run_offline(texts: list[str], concurrency: int, gen_len: int, extra: dict) -> dict:
    """The same prompts through the offline API in this process (nothing else running): the rate
    the server is measured against."""
    from ruvllm import LLM, SamplingParams

    llm = LLM(**extra)
    params = SamplingParams(temperature=0, max_tokens=gen_len, ignore_eos=True)
    llm.generate([WARM_UP], SamplingParams(max_tokens=4))  # as the server gets
    start = time.perf_counter()
    outs = llm.generate(texts[:concurrency], params)
    wall = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"concurrency": concurrency, "output_tok_s": tokens / wall, "ttft_p50": float("nan"),
            "ttft_p99": float("nan"), "e2e_mean": wall, "tokens": tokens}


def summarize(rows: list[dict]) -> list[dict]:
    """One row per (server, concurrency): medians over rounds, and our rate against the peer's taken
    within each round (median and range) and against the offline engine."""
    keys = list(dict.fromkeys((r["server"], r["concurrency"]) for r in rows))
    group = {k: [r for r in rows if (r["server"], r["concurrency"]) == k] for k in keys}
    out = []
    for (server, n), rs in group.items():
        row = {"server": server, "concurrency": n, "vs_peer": "", "vs_peer_range": "", "vs_offline": ""}
        for field in ("output_tok_s", "ttft_p50", "ttft_p99", "e2e_mean"):
            row[field] = statistics.median(r[field] for r in rs)
        if server.startswith("ruvllm"):
            peer = group.get(("llama-server", n)) or group.get(("peer", n)) or []
            peer_by_round = {r.get("round"): r for r in peer}
            ratios = [r["output_tok_s"] / peer_by_round[r.get("round")]["output_tok_s"]
                      for r in rs if r.get("round") in peer_by_round]
            if ratios:
                row["vs_peer"] = f"{statistics.median(ratios):.2f}x"
                row["vs_peer_range"] = f"{min(ratios):.2f}-{max(ratios):.2f}x"
            offline = group.get(("offline (LLM)", n))
            if offline:
                row["vs_offline"] = f"{row['output_tok_s'] / statistics.median(r['output_tok_s'] for r in offline):.2f}x"
        out.append(row)
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_up(url: str, proc: subprocess.Popen, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError("server did not come up")


def start_ruvllm(concurrency: int, extra: list[str], model_path: str | None = None,
                 served_name: str | None = None) -> tuple[subprocess.Popen, str]:
    port = _free_port()
    model = [model_path] if model_path else []
    # Served under the name the requests send (`serve FILE.gguf` would answer only to the path).
    name = ["--served-model-name", served_name] if served_name else []
    proc = subprocess.Popen([sys.executable, "-m", "ruvllm.cli.main", "serve", *model, "--port", str(port),
                             "--max-concurrent", str(max(concurrency, 1)), *name, *extra],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    _wait_up(url, proc)
    return proc, url


def start_llama_server(binary: str, concurrency: int, threads: int,
                       model_path: str | None = None) -> tuple[subprocess.Popen, str]:
    from ruvllm.loader import default_model_path
    port = _free_port()
    proc = subprocess.Popen([binary, "-m", model_path or str(default_model_path()), "--port", str(port), "--parallel",
                             str(concurrency), "-c", str(512 * concurrency), "-t", str(threads), "--no-webui"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    _wait_up(url, proc)
    return proc, url


def llama_server_version(binary: str) -> str:
    try:
        out = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=30)
        return (out.stdout + out.stderr).strip().splitlines()[0]
    except (OSError, subprocess.SubprocessError, IndexError):
        return "unknown"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base-url", help="a running ruvllm (or any) server")
    ap.add_argument("--base-label", default="ruvllm", help="its name in the table (e.g. 'ruvllm before')")
    ap.add_argument("--offline", action="store_true",
                    help="also run the same prompts through ruvllm's offline LLM API (the reference rate)")
    ap.add_argument("--peer-url", help="a running peer server to compare with")
    ap.add_argument("--start-ruvllm", action="store_true", help="start `ruvllm serve` per concurrency level")
    ap.add_argument("--ruvllm-args", default="", help="extra arguments for the started ruvllm serve")
    ap.add_argument("--llama-server", help="path of a llama-server binary to start on the same GGUF")
    ap.add_argument("--threads", type=int, default=2, help="llama-server threads")
    ap.add_argument("--model", default="SmolLM2-135M-Instruct", help="the model name sent in requests")
    ap.add_argument("--model-path", help="the GGUF both started servers load (default: the embedded model)")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--gen-len", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=1,
                    help="load runs per server and level, the servers taking turns; the table gives medians")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    if not (args.base_url or args.start_ruvllm or args.peer_url or args.llama_server or args.offline):
        ap.error("give at least one server: --base-url, --start-ruvllm, --peer-url or --llama-server")

    console = Console()
    texts = prompts(max(args.concurrency) * args.rounds, args.prompt_len, args.model_path)
    rows = []
    for n in args.concurrency:
        # (name, URL of a running server, or a function that starts one for this concurrency)
        targets = []
        if args.base_url:
            targets.append((args.base_label, args.base_url, None))
        if args.start_ruvllm:
            targets.append(("ruvllm", None, lambda n=n: start_ruvllm(n, args.ruvllm_args.split(), args.model_path,
                                                                     args.model)))
        if args.peer_url:
            targets.append(("peer", args.peer_url, None))
        if args.llama_server:
            targets.append(("llama-server", None, lambda n=n: start_llama_server(args.llama_server, n, args.threads,
                                                                                 args.model_path)))
        procs = []
        try:
            # Every server is up for the whole level and they take turns, round after round: a drift in
            # the host's speed then slows both sides of a round alike (an idle server costs nothing).
            urls = []
            for name, url, start in targets:
                if start is not None:
                    with console.status(f"starting {name} for {n} clients"):
                        proc, url = start()
                    procs.append(proc)
                urls.append((name, url))
            for rnd in range(args.rounds):
                for name, url in urls:
                    # Fresh prompts every round: a repeated one would be served from the prefix cache.
                    batch = texts[rnd * n:(rnd + 1) * n]
                    with console.status(f"{name}: {n} concurrent clients, round {rnd + 1}/{args.rounds}"):
                        try:
                            row = asyncio.run(run_load(url, args.model, batch, n, args.gen_len))
                        except httpx.HTTPError as exc:
                            raise SystemExit(f"{name} ({n} clients, round {rnd + 1}): {type(exc).__name__}: {exc}")
                    row.update(server=name, round=rnd)
                    rows.append(row)
        finally:
            for proc in procs:
                proc.terminate()
                proc.wait(timeout=60)
    if args.offline:  # last, alone on the machine
        for n in args.concurrency:
            with console.status(f"offline: {n} prompts"):
                row = run_offline(texts[:n], n, args.gen_len, {"model": args.model_path})
            row["server"] = "offline (LLM)"
            rows.append(row)

    title = f"serve load: {args.prompt_len}-token prompts, {args.gen_len} generated (ignore_eos), streaming"
    if args.rounds > 1:
        title += f"; medians of {args.rounds} rounds"
    if args.llama_server:
        title += f"; peer: {llama_server_version(args.llama_server)}"
    table = Table(title=title)
    for col in ("server", "clients", "output tok/s", "TTFT p50 (s)", "TTFT p99 (s)", "e2e mean (s)", "vs peer",
                "vs peer range", "vs offline"):
        table.add_column(col, justify="right")
    for row in summarize(rows):
        table.add_row(row["server"], str(row["concurrency"]), f"{row['output_tok_s']:.1f}",
                      f"{row['ttft_p50']:.2f}", f"{row['ttft_p99']:.2f}", f"{row['e2e_mean']:.2f}",
                      row["vs_peer"], row["vs_peer_range"], row["vs_offline"])
    console.print(table)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
