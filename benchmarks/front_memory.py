"""The server's memory through the bad-input table (issue 33, item 12): starts `ruvllm serve` (default
model), sends tests/server/test_bad_input.py's cases plus the large ones (10 MB bodies to the
generation and tokenize routes, a 1M-token detokenize, a body over the 16 MiB limit) --rounds times,
and prints the front's and the core's RSS (/proc/PID/status) before, at the peak (VmHWM) and after
each round. --no-trim serves without the trim after large requests (guards.py), as before issue 33's
item 12 was mended; MALLOC_ARENA_MAX and other glibc settings pass to the server from the environment.

    .venv/bin/python benchmarks/front_memory.py [--rounds 3] [--no-trim] [--ruvllm-args "..."]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from serve_load import _free_port, _wait_up  # noqa: E402

from tests.server.test_bad_input import CASES, CHAT, COMP, MODEL  # noqa: E402

TEXT = "It is a truth universally acknowledged. "
LARGE = [
    ("/v1/completions", {**COMP, "prompt": TEXT * 250_000}),  # 10 MB: tokenized, then over the context
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": TEXT * 250_000}]}),
    ("/tokenize", {"prompt": TEXT * 250_000}),  # 10 MB in, 2.25M ids out
    ("/detokenize", {"tokens": [1000 + i % 5000 for i in range(1_000_000)]}),
    ("/v1/completions", {**COMP, "prompt": [5] * 1_500_000}),  # 10 MB of ids
    ("/v1/completions", {**COMP, "prompt": "x" * 17_000_000}),  # over --max-request-bytes: 413
]


def rss_mb(pid: int) -> dict[str, float]:
    with open(f"/proc/{pid}/status") as f:
        fields = dict(line.split(":", 1) for line in f)
    return {k: int(fields[k].split()[0]) / 1024 for k in ("VmRSS", "VmHWM")}


def core_pid(pid: int) -> int:
    kids = [int(k) for task in os.listdir(f"/proc/{pid}/task")
            for k in open(f"/proc/{pid}/task/{task}/children").read().split()]
    return kids[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--settle", type=float, default=3.0, help="seconds between a round's end and 'after'")
    ap.add_argument("--no-trim", action="store_true", help="serve without malloc_trim after large requests")
    ap.add_argument("--ruvllm-args", default="")
    args = ap.parse_args()
    port = _free_port()
    off = "import ruvllm.server.guards as g; g.TRIM_AFTER_BYTES = 1 << 62; " if args.no_trim else ""
    proc = subprocess.Popen([sys.executable, "-c", f"{off}from ruvllm.cli.main import main; main()", "serve",
                             "--port", str(port), "--served-model-name", MODEL, *args.ruvllm_args.split()],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    _wait_up(url, proc)
    try:
        front, core = proc.pid, core_pid(proc.pid)
        with httpx.Client(base_url=url, timeout=600) as c:
            c.post("/v1/completions", json=COMP).raise_for_status()  # warm: the first request's allocations
            time.sleep(args.settle)
            base = rss_mb(front)["VmRSS"], rss_mb(core)["VmRSS"]
            print(f"before: front {base[0]:.0f} MB, core {base[1]:.0f} MB")
            for n in range(args.rounds):
                statuses: dict[int, int] = {}
                start = time.perf_counter()
                for path, body in [(p, b) for p, b, *_ in CASES] + LARGE:
                    raw = body.encode() if isinstance(body, str) else json.dumps(body).encode()
                    r = c.post(path, content=raw, headers={"content-type": "application/json"})
                    statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
                took = time.perf_counter() - start
                time.sleep(args.settle)
                f, k = rss_mb(front), rss_mb(core)
                print(f"round {n + 1} ({took:.0f} s, statuses {dict(sorted(statuses.items()))}): "
                      f"front peak {f['VmHWM']:.0f} MB, after {f['VmRSS']:.0f} MB; "
                      f"core peak {k['VmHWM']:.0f} MB, after {k['VmRSS']:.0f} MB")
    finally:
        proc.terminate()
        proc.wait(60)


if __name__ == "__main__":
    main()
