"""One stream's decode rate through the server against the same engine offline (issue 34, item 4).

- offline: `LLM`'s core stepped in this process, as benchmarks/vs_llama_bench.py's `decode_rate`
  measures llama-bench's tg (N tokens after a 1-token prompt; the tokens after the first over the
  time after the first);
- server: `ruvllm serve` (the core in its own process, as users run it) started by this script, one
  streaming `/v1/completions` client sending the same 1-token prompt (greedy, ignore_eos), timed the
  same way on the client: from the first token's SSE chunk to the last one's. Everything between the
  core's step and the client's socket is in it: the core's message, the front's detokenizer and
  output processor, the SSE chunk and the HTTP write;
- `--url URL` adds an already running server (another commit's, say) as a third arm;
- `--before COMMIT` adds that commit's server as a third arm, started by this script from its `src/`
  (`git archive`, first on the server's PYTHONPATH: its front and its core process), so a change's
  ratio is taken against its predecessor's in the same rounds.

Arms alternate within each round (the first of a round rotating), for `--rounds` rounds; the table
gives medians and the server over offline within each round (median and range), so a noisy
neighbour on a shared machine slows both sides of a round alike. The 1-minute load average is printed
with the table.

    .venv/bin/python benchmarks/server_vs_offline.py --rounds 7 --tokens 128
    .venv/bin/python benchmarks/server_vs_offline.py --model /path/to/smollm2-1.7b.gguf --tokens 64
    .venv/bin/python benchmarks/server_vs_offline.py --rounds 7 --before 8729ce0
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script: `benchmarks.` imports

from benchmarks.serve_load import _free_port, _wait_up, start_ruvllm  # noqa: E402
from benchmarks.vs_llama_bench import decode_rate  # noqa: E402
from benchmarks.vs_llama_realistic import LoadSampler, machine  # noqa: E402

SERVED = "bench"


def cpu_seconds(pid: int) -> dict[str, float]:
    """CPU seconds (user + system) each thread of a process has used so far, by thread name."""
    tick = os.sysconf("SC_CLK_TCK")
    out: dict[str, float] = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            stat = (task / "stat").read_text()
        except OSError:
            continue  # the thread ended meanwhile
        name = stat[stat.index("(") + 1:stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2:].split()
        out[name] = out.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / tick
    return out


def core_pid(front: int) -> int | None:
    """The engine core's process: the server's child."""
    children = Path(f"/proc/{front}/task/{front}/children").read_text().split()
    return int(children[0]) if children else None


def stream_rate(client: httpx.Client, url: str, tokens: int) -> float:
    """One streaming client's tokens after the first over the time after the first (client clock)."""
    body = {"model": SERVED, "prompt": [1], "max_tokens": tokens, "temperature": 0, "stream": True,
            "ignore_eos": True}
    first = last = None
    n = 0
    with client.stream("POST", url + "/v1/completions", json=body) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            choices = json.loads(line[6:])["choices"]
            if choices and (choices[0]["text"] or choices[0]["finish_reason"] is None):
                last = time.perf_counter()
                first = first or last
                n += 1
    assert first is not None and last is not None and n == tokens, (n, tokens)
    return (tokens - 1) / (last - first)


def start_from(src: Path, extra: list[str], model: str | None) -> tuple[subprocess.Popen, str]:
    """`ruvllm serve` run from another tree's `src/` (served as SERVED), as start_ruvllm starts this one's."""
    port = _free_port()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(src), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.Popen([sys.executable, "-m", "ruvllm.cli.main", "serve", *([model] if model else []),
                             "--port", str(port), "--max-concurrent", "1", "--served-model-name", SERVED, *extra],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    _wait_up(url, proc)
    return proc, url


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="model path or name (default: the default model)")
    ap.add_argument("--tokens", type=int, default=128, help="tokens generated per measurement")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--url", default=None, help="also measure this running server (served as `bench`)")
    ap.add_argument("--url-label", default="server at --url")
    ap.add_argument("--before", default=None, metavar="COMMIT",
                    help="also measure COMMIT's server (its src/ from git archive), started by this script")
    ap.add_argument("--threads", type=int, default=None,
                    help="CPU threads of both engines (default: every core; on a loaded host 1 keeps OpenMP's "
                         "waits from dominating both arms)")
    ap.add_argument("--serve-arg", action="append", default=[], help="extra `ruvllm serve` argument (repeat)")
    args = ap.parse_args()

    from ruvllm import LLM, SamplingParams

    threads = ["--threads", str(args.threads)] if args.threads else []
    proc, url = start_ruvllm(1, [*threads, *args.serve_arg], args.model, SERVED)
    tmp = tempfile.TemporaryDirectory(prefix="server-vs-offline-")
    old: subprocess.Popen | None = None  # --before's server
    try:
        if args.before:
            from benchmarks.front_cpu import archive_src  # (it imports this module)

            old, old_url = start_from(archive_src(args.before, Path(tmp.name)), [*threads, *args.serve_arg],
                                            args.model)
        llm = LLM(args.model, num_threads=args.threads)
        llm.generate([[1] * 8], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))  # warm-up
        client = httpx.Client(timeout=httpx.Timeout(3600))
        arms = {"offline (LLM core)": lambda i: decode_rate(llm, args.tokens, f"tg{i}"),
                "server (this tree)": lambda i: stream_rate(client, url, args.tokens)}
        if args.url:
            arms[args.url_label] = lambda i: stream_rate(client, args.url, args.tokens)
        if old is not None:
            arms[f"server ({args.before})"] = lambda i: stream_rate(client, old_url, args.tokens)
        for name, fn in arms.items():  # warm-up of each arm (first HTTP connection, first stream)
            fn(-1 - len(name))
        rates: dict[str, list[float]] = {name: [] for name in arms}
        names = list(arms)
        # The servers this script started, measured by CPU: their front (by thread) and their core process
        pids = {names[1]: proc.pid, **({names[-1]: old.pid} if old is not None else {})}
        cores = {name: core_pid(pid) for name, pid in pids.items()}
        front_cpu: dict[str, dict[str, float]] = {name: {} for name in pids}
        core_cpu = {name: 0.0 for name in pids}
        offline_cpu = 0.0
        with LoadSampler() as load:
            for rnd in range(args.rounds):
                k = rnd % len(names)
                for name in names[k:] + names[:k]:
                    if name in pids:
                        core = cores[name]
                        before = cpu_seconds(pids[name])
                        core_before = sum(cpu_seconds(core).values()) if core else 0.0
                    own_before = time.process_time()
                    rates[name].append(arms[name](rnd))
                    if name == names[0]:
                        offline_cpu += time.process_time() - own_before
                    if name in pids:
                        for t, v in cpu_seconds(pids[name]).items():
                            front_cpu[name][t] = front_cpu[name].get(t, 0.0) + v - before.get(t, 0.0)
                        core_cpu[name] += (sum(cpu_seconds(core).values()) if core else 0.0) - core_before
                print(f"round {rnd + 1}: " + ", ".join(f"{n} {r[-1]:.1f}" for n, r in rates.items()), flush=True)
    finally:
        for p in (proc, old):
            if p is not None:
                p.terminate()
                p.wait(30)
        tmp.cleanup()

    off = rates[names[0]]
    print(f"\n{datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC; {machine()}; model {args.model or 'default'}; "
          f"{args.tokens} tokens after a 1-token prompt, greedy; threads {args.threads or 'all'}; {args.rounds} rounds; "
          f"{load.summary()}")
    print("| arm | decode tok/s (median) | range | vs offline (median of rounds) | range |")
    print("|---|---|---|---|---|")
    for name in names:
        r = rates[name]
        ratio = [a / b for a, b in zip(r, off)]
        print(f"| {name} | {statistics.median(r):.1f} | {min(r):.1f}-{max(r):.1f} | "
              f"{statistics.median(ratio):.3f}x | {min(ratio):.3f}-{max(ratio):.3f} |")
    per_token = 1000 / (args.tokens * args.rounds)
    print(f"CPU per token: offline {offline_cpu * per_token:.2f} ms (this process)")
    for name, front in front_cpu.items():
        threads = ", ".join(f"{t} {v * per_token:.2f}" for t, v in sorted(front.items(), key=lambda kv: -kv[1]) if v)
        print(f"CPU per token, {name}: core process {core_cpu[name] * per_token:.2f} ms, "
              f"front {sum(front.values()) * per_token:.2f} ms ({threads})")
    print(f"(load average now {os.getloadavg()[0]:.1f})")


if __name__ == "__main__":
    main()
