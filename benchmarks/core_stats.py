"""What EngineCore.stats() costs built (after a change: every step is one) and as kept between
changes, on the tiny in-memory engine of tests/engine_fixtures.py. The arms alternate, so a loaded
host slows both alike; the load average is printed beside the table.

    .venv/bin/python benchmarks/core_stats.py [--rounds 7] [--calls 5000]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.engine_fixtures import tiny_llm  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--calls", type=int, default=5000)
    args = ap.parse_args()
    core = tiny_llm("cpu").core

    def arm(changed: bool) -> float:
        t = time.perf_counter()
        for _ in range(args.calls):
            if changed:
                core._stats_dirty = True  # as a step leaves it
            core.stats()
        return (time.perf_counter() - t) / args.calls * 1e6

    built, kept = [], []
    for _ in range(args.rounds):
        built.append(arm(True))
        kept.append(arm(False))
    print(f"| stats() | us a call (median of {args.rounds} alternated rounds) |")
    print("|---|---|")
    print(f"| built (after a change) | {statistics.median(built):.2f} |")
    print(f"| kept (no change) | {statistics.median(kept):.2f} |")
    print(f"load average: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
