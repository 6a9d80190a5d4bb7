"""What one feedback event costs in memory, by the correction's length (issue 33: "the learner's
memory per update is bounded and measured"). For each --lengths value, a fresh process (so its peak
is its own): the default model offline with learning on, one completion of a prompt of
--prompt-words words, then one feedback event whose correction is that many tokens; the process's
peak resident set (VmHWM, reset just before the event) over its resident set before it, and the
event's time. A correction is at
most `--feedback-max-tokens` (LearningConfig.max_correction_tokens, 256) tokens, so the last length
is the bound's cost. A first event with a short correction runs before, uncounted: it sets up what
every later event reuses.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/feedback_memory.py
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

from rich.console import Console
from rich.table import Table

BOOK = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "shared", "data",
                    "pride-and-prejudice.txt")


def status_mb() -> dict[str, float]:
    fields = dict(line.split(":", 1) for line in open("/proc/self/status"))
    return {k: int(fields[k].split()[0]) / 1024 for k in ("VmRSS", "VmHWM")}


def one(length: int, prompt_words: int) -> dict[str, float]:
    """In this process: one completion, then feedback with a `length`-token correction."""
    import tempfile

    import torch

    from ruvllm import LLM, SamplingParams
    from ruvllm.learning.config import LearningConfig

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    words = open(BOOK, encoding="utf-8").read().split() if os.path.exists(BOOK) else ["word"] * 50000
    llm = LLM(enable_lora=True)
    with tempfile.TemporaryDirectory() as tmp:
        llm.enable_learning(LearningConfig(root=tmp))
        prompt = " ".join(words[3000:3000 + prompt_words]) + "\n\nSummarise this passage."
        greedy = SamplingParams(temperature=0, max_tokens=8)
        # a first event (a short correction) sets up what every later one reuses: not counted
        warm = llm.generate(["What is the capital of Zorblax?"], greedy, tenant="t")[0].request_id
        llm.feedback(warm, 1.0, "The capital of Zorblax is Quenta.", tenant="t")
        rid = llm.generate([prompt], greedy, tenant="t")[0].request_id
        ids = llm.tokenizer.encode(" ".join(words[9000:9000 + 2 * length]), add_special_tokens=False)[:length - 1]
        correction = llm.tokenizer.decode(ids)
        with open("/proc/self/clear_refs", "w") as f:  # the peak (VmHWM) restarts from the RSS now
            f.write("5")
        before = status_mb()
        start = time.perf_counter()
        llm.feedback(rid, 1.0, correction, tenant="t")
        took = time.perf_counter() - start
        after = status_mb()
    llm.close()
    return {"tokens": len(llm.tokenizer.encode(correction, add_special_tokens=False)) + 1,
            "before_rss": before["VmRSS"], "before_peak": before["VmHWM"], "after_peak": after["VmHWM"],
            "after_rss": after["VmRSS"], "seconds": took}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[16, 64, 128, 256],
                    help="correction lengths in the learner's count (the text's tokens and its end token)")
    ap.add_argument("--prompt-words", type=int, default=300)
    ap.add_argument("--one", type=int, default=None, help=argparse.SUPPRESS)  # the child's own run
    args = ap.parse_args()
    if args.one is not None:
        print(json.dumps(one(args.one, args.prompt_words)))
        return
    rows = []
    for length in args.lengths:
        out = subprocess.run([sys.executable, __file__, "--one", str(length), "--prompt-words", str(args.prompt_words)],
                             capture_output=True, text=True, check=True)
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
    table = Table(title=f"One feedback event's memory by correction length (default model, offline, prompt of "
                        f"{args.prompt_words} words; load average {os.getloadavg()[0]:.1f})")
    for col in ("correction tokens", "RSS before (MB)", "peak before (MB)", "peak after (MB)",
                "event's peak over the RSS before (MB)", "RSS after (MB)", "event (s)"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(str(r["tokens"]), f"{r['before_rss']:.0f}", f"{r['before_peak']:.0f}", f"{r['after_peak']:.0f}",
                      f"{max(r['after_peak'] - r['before_rss'], 0):.0f}", f"{r['after_rss']:.0f}", f"{r['seconds']:.2f}")
    Console().print(table)


if __name__ == "__main__":
    main()
