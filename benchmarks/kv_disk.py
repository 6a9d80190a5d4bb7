"""The disk KV tier (--kv-disk-path): time to first token of a long prompt served from disk after a
restart against computing it, and what spilling evicted blocks to disk costs a many-stream run.

TTFT: one --prompt-tokens prompt cut from a text file, max_tokens=1 (the call's time is the time to
its first token). "recompute": an engine with an empty prefix cache and no disk tier. "disk after
a restart": a first engine computed the prompt and closed (its cached blocks written to the tier);
each repetition is a new engine (a new pool and scheduler, the tier's index rebuilt from the folder)
over the same loaded weights, the block files in the OS page cache; "disk, cold page cache" drops
them from the page cache first (posix_fadvise DONTNEED), as after a reboot. "memory hit": the same
prompt again in one engine, for scale.

Spilling: --streams sequences at once, each a distinct --stream-prompt-tokens prompt generating
--stream-gen tokens, for --rounds rounds of new prompts on a pool of about one round's blocks, so
every round evicts the previous round's cached blocks: with the tier each of those is copied out
and written. Wall time and the process's CPU time (every thread: the writer's work included; on a
shared machine far steadier than wall time) with the tier against without, alternated --repeats
times (medians).

    .venv/bin/python benchmarks/kv_disk.py ../shared/data/pride-and-prejudice.txt
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from ruvllm import LLM, SamplingParams
from ruvllm.config import CacheConfig

FIRST = SamplingParams(max_tokens=1, temperature=0)


def timed(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> float:
    t0 = time.perf_counter()
    llm.generate(prompts, params)
    return time.perf_counter() - t0


def drop_page_cache(folder: Path) -> None:
    for p in folder.rglob("*.kvb"):
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def ttft_rows(base: LLM, prompt: list[int], folder: Path, repeats: int, num_blocks: int) -> list[tuple[str, float, str]]:
    plain = CacheConfig(num_blocks=num_blocks)
    disk = CacheConfig(num_blocks=num_blocks, kv_disk_path=str(folder))
    recompute = []
    for _ in range(repeats):
        e = base.with_settings(cache=plain)
        recompute.append(timed(e, [prompt], FIRST))
        e.close()
    first = base.with_settings(cache=disk)
    timed(first, [prompt], FIRST)
    memory = timed(first, [prompt], FIRST)
    first.close()  # writes the cached blocks
    warm, cold, hits = [], [], 0
    for dropped in [False] * repeats + [True] * repeats:
        if dropped:
            drop_page_cache(folder)
        e = base.with_settings(cache=disk)
        (cold if dropped else warm).append(timed(e, [prompt], FIRST))
        hits = e.stats().disk_hits
        e.close()
    r = statistics.median(recompute)
    return [("recompute (no cached block)", r, "1.00"),
            ("disk after a restart, page cache warm", statistics.median(warm), f"{statistics.median(warm) / r:.3f}"),
            ("disk after a restart, page cache dropped", statistics.median(cold), f"{statistics.median(cold) / r:.3f}"),
            ("memory hit (same engine)", memory, f"{memory / r:.3f}"),
            (f"  (tokens from disk per request: {hits} of {len(prompt)})", float("nan"), "")]


def spill_rows(base: LLM, text_ids: list[int], folder: Path, args: argparse.Namespace) -> list[tuple[str, float, str]]:
    n, plen, gen = args.streams, args.stream_prompt_tokens, args.stream_gen
    rounds = [[text_ids[(r * n + i) * plen:(r * n + i + 1) * plen] for i in range(n)] for r in range(args.rounds)]
    blocks = n * (-(-(plen + gen) // 16)) + 16  # one round's blocks: each round evicts the last one's
    params = SamplingParams(max_tokens=gen, temperature=0, ignore_eos=True)
    off, on, off_cpu, on_cpu, written = [], [], [], [], 0
    for rep in range(args.repeats):
        for with_tier in ((False, True) if rep % 2 == 0 else (True, False)):
            shutil.rmtree(folder, ignore_errors=True)
            cache = CacheConfig(num_blocks=blocks, kv_disk_path=str(folder) if with_tier else None)
            e = base.with_settings(cache=cache)
            cpu = time.process_time()
            t = sum(timed(e, batch, params) for batch in rounds)
            if with_tier:
                e.core.executor.kv_disk.flush()  # its writes count, all of them
                written = e.core.executor.kv_disk.stats.written
            (on_cpu if with_tier else off_cpu).append(time.process_time() - cpu)
            e.close()
            (on if with_tier else off).append(t)
    a, b = statistics.median(off), statistics.median(on)
    ca, cb = statistics.median(off_cpu), statistics.median(on_cpu)
    tokens = args.rounds * n * gen
    return [(f"{n} streams, no disk tier ({tokens} tokens out): wall", a, "1.00"),
            (f"{n} streams, spilling to disk ({written} blocks written): wall", b, f"{b / a:.3f}"),
            ("  the same, CPU seconds of the process: no disk tier", ca, "1.00"),
            ("  the same, CPU seconds of the process: spilling", cb, f"{cb / ca:.3f}")]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("path", type=Path)
    ap.add_argument("--model", default=None, help="default: the embedded model")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--prompt-tokens", type=int, default=4000)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--streams", type=int, default=32)
    ap.add_argument("--stream-prompt-tokens", type=int, default=256)
    ap.add_argument("--stream-gen", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--skip-ttft", action="store_true")
    ap.add_argument("--skip-spill", action="store_true")
    args = ap.parse_args()
    base = LLM(args.model, dtype=args.dtype, num_blocks=16)
    ids = base.tokenizer.encode(args.path.read_text(encoding="utf-8"))
    console = Console()
    console.print(f"model {base.info.model} ({base.info.dtype}, {base.info.quantization}), max context "
                  f"{base.info.max_model_len}, {base.info.hot_block_bytes / 2**20:.2f} MiB per block")
    table = Table("case", "seconds", "x recompute / x no tier")
    folder = Path(tempfile.mkdtemp(prefix="ruvllm-kv-disk-bench-"))
    try:
        if not args.skip_ttft:
            prompt = ids[1000:1000 + args.prompt_tokens]
            num_blocks = -(-(args.prompt_tokens + 16) // 16) + 8
            for row in ttft_rows(base, prompt, folder / "ttft", args.repeats, num_blocks):
                table.add_row(row[0], "" if row[1] != row[1] else f"{row[1]:.3f}", row[2])
        if not args.skip_spill:
            for row in spill_rows(base, ids, folder / "spill", args):
                table.add_row(row[0], f"{row[1]:.2f}", row[2])
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    console.print(table)


if __name__ == "__main__":
    main()
