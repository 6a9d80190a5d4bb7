"""The server front's CPU time per streamed token, this tree against another commit's (issue 34, item 4).

At one stream on a 2-core machine, whatever CPU the front (HTTP, event loop, output thread,
detokenizer) spends a token is taken from the cores the engine computes on, so it is the server's
gap to the offline rate (benchmarks/server_vs_offline.py). This measures it directly, as the CPU
time each of the front process's threads used (`/proc/<pid>/task/*/stat`, user + system) over
`--streams` sequential streams of `--tokens` tokens, with a model whose step costs next to nothing
(the `tiny` random-weight GGUF of benchmarks/random_gguf.py, one engine thread), so the front is the
limit and a busy machine changes the CPU a token little (the rate, much).

Arms: `this tree` (the checkout this script is in) and, for each `--before COMMIT`, that commit's
`src/` (`git archive`, first on the servers' PYTHONPATH: its front and its core process). Every server is
up for the whole run; each round measures every arm once, the first of a round rotating. The
1-minute load average is printed with the table.

    .venv/bin/python benchmarks/front_cpu.py --before HEAD --rounds 4
    .venv/bin/python benchmarks/front_cpu.py --before 8729ce0 --before af63c1f --rounds 4 --streams 12
"""

from __future__ import annotations

import argparse
import io
import json
import os
import socket
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run as a script: `benchmarks.` imports

from benchmarks.random_gguf import random_gguf  # noqa: E402
from benchmarks.serve_load import _free_port, _wait_up  # noqa: E402
from benchmarks.server_vs_offline import core_pid  # noqa: E402

def thread_cpu(pid: int) -> dict[str, float]:
    """CPU seconds (user + system) of each thread of a process, keyed `name#k`: its name and its rank
    by thread id (creation order), as Python threads all carry the interpreter's name; and the
    process's system time alone under `(system)`."""
    tick = os.sysconf("SC_CLK_TCK")
    out: dict[str, float] = {}
    tids = sorted(int(t.name) for t in Path(f"/proc/{pid}/task").iterdir())
    for k, tid in enumerate(tids):
        try:
            stat = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
        except OSError:
            continue  # the thread ended meanwhile
        name = stat[stat.index("(") + 1:stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2:].split()
        out[f"{name}#{k}"] = (int(fields[11]) + int(fields[12])) / tick
        out["(system)"] = out.get("(system)", 0.0) + int(fields[12]) / tick
    return out

from benchmarks.vs_llama_realistic import LoadSampler, machine  # noqa: E402

SERVED = "bench"


def archive_src(commit: str, into: Path) -> Path:
    """`commit`'s src/ extracted under `into`; its path (for PYTHONPATH)."""
    data = subprocess.run(["git", "-C", str(ROOT), "archive", commit, "src"], check=True, capture_output=True).stdout
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        tar.extractall(into, filter="data")
    return into / "src"


def start(model: Path, src: Path | None, extra: list[str]) -> tuple[subprocess.Popen, str]:
    port = _free_port()
    env = dict(os.environ)
    if src is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(src), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    proc = subprocess.Popen([sys.executable, "-m", "ruvllm.cli.main", "serve", str(model), "--port", str(port),
                             "--served-model-name", SERVED, "--threads", "1", *extra],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    _wait_up(url, proc)
    return proc, url


def stream(url: str, tokens: int) -> int:
    """One streaming /v1/completions request over a plain socket (the client's own CPU kept small:
    it only counts the SSE events); the number of token events."""
    host, port = url.removeprefix("http://").split(":")
    body = json.dumps({"model": SERVED, "prompt": [1], "max_tokens": tokens, "temperature": 0, "stream": True,
                       "ignore_eos": True}).encode()
    head = (f"POST /v1/completions HTTP/1.1\r\nhost: {host}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\nconnection: close\r\n\r\n").encode()
    events = 0
    with socket.create_connection((host, int(port))) as s:
        s.sendall(head + body)
        while chunk := s.recv(65536):
            events += chunk.count(b"data: {")
    return events


def measure(proc: subprocess.Popen, url: str, streams: int, tokens: int) -> dict[str, float]:
    """Front CPU ms a token by thread, the core's, the client's, and the rate (tok/s over the streams)."""
    core = core_pid(proc.pid)
    front0, core0, own0 = thread_cpu(proc.pid), thread_cpu(core), time.process_time()
    t0 = time.perf_counter()
    n = sum(stream(url, tokens) for _ in range(streams))
    wall = time.perf_counter() - t0
    front1, core1, own1 = thread_cpu(proc.pid), thread_cpu(core), time.process_time()
    per = 1000 / n
    out = {f"front: {t}": (v - front0.get(t, 0.0)) * per for t, v in front1.items() if t != "(system)"}
    out["front"] = sum(out.values())
    out["front (system)"] = (front1["(system)"] - front0["(system)"]) * per
    out["core process"] = sum(v - core0.get(t, 0.0) for t, v in core1.items() if t != "(system)") * per
    for t, v in core1.items():  # its ZeroMQ I/O thread: the work a step's message costs beside the step
        if t.startswith("ZMQbg/IO"):
            out[f"core: {t}"] = (v - core0.get(t, 0.0)) * per
    out["client"] = (own1 - own0) * per
    out["tok/s"] = n / wall
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--before", action="append", default=[],
                    help="also measure this commit's src/ (git archive; repeat for several)")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--streams", type=int, default=8, help="sequential streams a measurement")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--serve-arg", action="append", default=[], help="extra `ruvllm serve` argument (repeat)")
    args = ap.parse_args()

    model = random_gguf("tiny")
    arms: dict[str, Path | None] = {"this tree": None}
    tmp = tempfile.TemporaryDirectory(prefix="front-cpu-")
    for i, commit in enumerate(args.before):
        arms[f"before ({commit})"] = archive_src(commit, Path(tmp.name) / str(i))
    servers: dict[str, tuple[subprocess.Popen, str]] = {}
    try:
        for name, src in arms.items():
            servers[name] = start(model, src, args.serve_arg)
            stream(servers[name][1], 16)  # warm-up: first connection, first stream
        names = list(arms)
        got: dict[str, list[dict[str, float]]] = {n: [] for n in names}
        with LoadSampler() as load:
            for rnd in range(args.rounds):
                k = rnd % len(names)
                for name in names[k:] + names[:k]:
                    got[name].append(measure(*servers[name], args.streams, args.tokens))
                print(f"round {rnd + 1}: " + ", ".join(f"{n} front {g[-1]['front']:.3f} ms/token "
                                                       f"({g[-1]['tok/s']:.0f} tok/s)" for n, g in got.items()),
                      flush=True)
    finally:
        for proc, _ in servers.values():
            proc.terminate()
            proc.wait(30)
        tmp.cleanup()

    print(f"\n{datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC; {machine()}; model {model.name} (one engine thread); "
          f"{args.rounds} rounds of {args.streams} streams x {args.tokens} tokens; {load.summary()}")
    threads = sorted({k for g in got.values() for m in g for k in m if k.startswith("front: ")},
                     key=lambda k: -statistics.median(m.get(k, 0.0) for m in got[names[0]]))
    threads = [t for t in threads if any(m.get(t, 0.0) > 0.005 for g in got.values() for m in g)]
    core_io = sorted({k for g in got.values() for m in g for k in m if k.startswith("core: ")})
    cols = ["tok/s", "front", "front (system)", *threads, "core process", *core_io, "client"]
    print("| arm | " + " | ".join(c if c == "tok/s" else f"{c} ms/token" for c in cols) + " |")
    print("|---|" + "---|" * len(cols))
    for name in names:
        cells = [statistics.median(m.get(c, 0.0) for m in got[name]) for c in cols]
        print(f"| {name} | " + " | ".join(f"{v:.0f}" if c == "tok/s" else f"{v:.3f}" for c, v in zip(cols, cells))
              + " |")
    print("(medians of rounds; 'front: NAME#K' is one thread of the front process: its name, K its rank by thread id)")
    print(f"(load average now {os.getloadavg()[0]:.1f})")


if __name__ == "__main__":
    main()
