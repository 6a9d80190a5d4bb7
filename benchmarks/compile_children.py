"""The grammar-compile processes a test session keeps alive: how many, and their resident memory.

Each engine that meets a structured request starts a compile zygote (about 290 MB; structured/compiler.py)
and the test fixtures keep their engines for the session. This runs the given test files in one pytest
process per arm, sampling every 0.5 s the processes under it that run ruvllm.structured.compiler, with
the zygote's idle exit set to each arm's value. Arm 0 is the behaviour before issue 33's fix: no idle
exit, and a core dropped without close() (a server fixture's) keeps its zygote. The others are as
shipped (a dropped core's compiler is closed) with that idle exit (120: the default). Arms run one
after the other (a whole session each); the load average is printed.

    .venv/bin/python benchmarks/compile_children.py tests/e2e/test_structured.py tests/server/test_tools_server.py
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time


def _sample(stop: threading.Event, out: list[tuple[float, int, int]]) -> None:
    import psutil

    me = psutil.Process()
    while not stop.wait(0.5):
        count = rss = 0
        for child in me.children(recursive=True):
            try:
                if "ruvllm.structured.compiler" in " ".join(child.cmdline()):
                    rss += child.memory_info().rss
                    count += 1
            except psutil.Error:  # gone meanwhile
                continue
        out.append((time.monotonic(), count, rss))


def _run_arm(idle_exit: float, files: list[str]) -> dict:
    """In this process: the test session with every compiler's idle_exit set, and what was sampled."""
    import pytest

    from ruvllm.structured import compiler

    init = compiler.GrammarCompiler.__init__

    def with_idle_exit(self, *args, **kwargs):
        kwargs["idle_exit"] = idle_exit
        init(self, *args, **kwargs)

    compiler.GrammarCompiler.__init__ = with_idle_exit  # the benchmark's arm, not a product setting
    if idle_exit == 0:  # before: nothing closed a dropped core's compiler
        from ruvllm.core import engine_core

        class _NoFinalize:
            @staticmethod
            def finalize(*_args, **_kwargs) -> None:
                return None

        engine_core.weakref = _NoFinalize  # type: ignore[assignment]
    samples: list[tuple[float, int, int]] = []
    stop = threading.Event()
    sampler = threading.Thread(target=_sample, args=(stop, samples), daemon=True)
    started = time.monotonic()
    sampler.start()
    code = pytest.main(["-n", "0", "-q", "-p", "no:warnings", "-p", "no:cacheprovider", *files])
    stop.set()
    sampler.join()
    wall = time.monotonic() - started
    rss = [r for _, _, r in samples]
    weighted = sum(r * 0.5 for r in rss) / max(wall, 1e-9)
    return {"exit": int(code), "wall_s": wall, "max_children": max((c for _, c, _ in samples), default=0),
            "max_rss_mb": max(rss, default=0) / 2**20, "mean_rss_mb": weighted / 2**20,
            "last_rss_mb": (rss[-1] if rss else 0) / 2**20, "load": os.getloadavg(),
            # processes alive, every 30 s of the session
            "timeline": [c for t, c, _ in samples if int((t - started) / 0.5) % 60 == 0]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("files", nargs="+")
    ap.add_argument("--arms", default="0,120", help="idle_exit values, comma-separated (0: never leaves)")
    ap.add_argument("--one-arm", type=float, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one_arm is not None:
        print("RESULT " + json.dumps(_run_arm(args.one_arm, args.files)), flush=True)
        return
    rows = []
    for arm in [float(a) for a in args.arms.split(",")]:
        env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
        done = subprocess.run([sys.executable, __file__, "--one-arm", str(arm), *args.files], env=env,
                              capture_output=True, text=True)
        line = next((ln for ln in done.stdout.splitlines() if ln.startswith("RESULT ")), None)
        if line is None:
            sys.exit(f"arm {arm}: no result\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
        rows.append((arm, json.loads(line[len("RESULT "):])))
    print("| idle exit | tests | wall | compile processes at most | their RSS at most | mean over the session "
          "| at the end | load average |")
    print("|---|---|---|---|---|---|---|---|")
    for arm, r in rows:
        print(f"| {'before (never, dropped cores keep theirs)' if arm == 0 else f'{arm:g} s'} | {'passed' if r['exit'] == 0 else 'exit ' + str(r['exit'])} "
              f"| {r['wall_s']:.0f} s | {r['max_children']} | {r['max_rss_mb']:,.0f} MB | {r['mean_rss_mb']:,.0f} MB "
              f"| {r['last_rss_mb']:,.0f} MB | {' '.join(f'{x:.1f}' for x in r['load'])} |")
    for arm, r in rows:
        print(f"idle exit {arm:g}: compile processes alive every 30 s: {r['timeline']}")


if __name__ == "__main__":
    main()
