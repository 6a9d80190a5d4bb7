"""Tensor parallelism's step time on gloo (docs/scaling.md, "Tensor parallelism"): TP = 2 against TP = 1,
as a correctness path on this CPU, not a speed claim.

    OMP_NUM_THREADS=1 COLUMNS=200 .venv/bin/python benchmarks/tensor_parallel.py

Random-weight Llama models in fp32 (every weight dense, as tensor parallelism runs them): the tiny
test model (2 layers, hidden 128), where a step is nearly all fixed costs, and a 30-layer model of
SmolLM2-135M's size with 8 heads (2 KV heads), which TP = 2 splits. Each engine's core is stepped
directly: a 128-token prompt (one prefill step), then decode steps of 1 sequence and of 8. TP = 1 runs
with 1 and with 2 threads; TP = 2 with 1 thread per rank (the same 2 cores). The last column is the
part of rank 0's step spent inside collectives (all-reduces, the logits' all-gather, its commands'
broadcasts), waiting for the other rank included. Medians over --rounds rounds of --steps decode steps.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

from ruvllm.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from ruvllm.core.engine_core import EngineCore
from ruvllm.messages import CoreRequest
from ruvllm.models.random_weights import RandomWeights
from ruvllm.sampling_params import SamplingParams
from ruvllm.worker.worker import Worker

TINY = ModelConfig("llama", vocab_size=512, hidden_size=128, intermediate_size=256, num_layers=2, num_heads=4,
                   num_kv_heads=2, head_dim=32, rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=2048,
                   tie_word_embeddings=False, eos_token_ids=(0,))
# SmolLM2-135M's depth, MLP and vocabulary (its 9 heads do not split in 2: 8 heads of 64 instead).
SMALL = dataclasses.replace(TINY, vocab_size=49152, hidden_size=512, intermediate_size=1536, num_layers=30,
                            num_heads=8, num_kv_heads=2, head_dim=64, tie_word_embeddings=True)
MODELS = {"tiny (2 layers, H 128)": TINY, "30 layers, H 512, 8/2 heads (~115M)": SMALL}
PROMPT = 128


def _core(cfg: ModelConfig, tp: int, threads: int) -> EngineCore:
    config = EngineConfig(dtype="float32", num_threads=threads, tensor_parallel_size=tp,
                          cache=CacheConfig(num_blocks=256, enable_prefix_caching=False),
                          scheduler=SchedulerConfig(max_num_batched_tokens=1024, max_num_seqs=16))
    return EngineCore(Worker.from_weights(cfg, RandomWeights(cfg, seed=0, std=0.1), config), config)


class _CollectiveClock:
    """Time rank 0 spends inside its group's collectives (wrapping the group's methods)."""

    def __init__(self, core: EngineCore) -> None:
        self.seconds, self.calls = 0.0, 0
        tp = core.executor.tensor_parallel  # type: ignore[attr-defined]
        if tp is None:
            return
        for name in ("all_reduce", "gather_columns", "broadcast"):
            setattr(tp.group, name, self._timed(getattr(tp.group, name)))

    def _timed(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*args: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*args)
            finally:
                self.seconds += time.perf_counter() - start
                self.calls += 1

        return wrapper


def _run(core: EngineCore, clock: _CollectiveClock, vocab: int, batch: int, steps: int, tag: str
         ) -> tuple[float, float, float, float]:
    """(prefill step s, median decode step s, share of decode steps in collectives, collectives per
    decode step)."""
    params = SamplingParams(temperature=0, max_tokens=steps + 1, ignore_eos=True)
    for i in range(batch):
        ids = [(17 * i + 31 * j) % (vocab - 2) + 2 for j in range(PROMPT)]
        core.add_request(CoreRequest(f"{tag}-{i}", ids, params))
    times, comm, calls = [], [], []
    while core.has_unfinished:
        clock.seconds, clock.calls = 0.0, 0
        start = time.perf_counter()
        core.step()
        times.append(time.perf_counter() - start)
        comm.append(clock.seconds)
        calls.append(clock.calls)
    # batch x 128 prompt tokens fit one step's budget (1024): step 0 prefills, the rest decode
    decode = times[1:]
    return times[0], statistics.median(decode), sum(comm[1:]) / sum(decode), statistics.median(calls[1:])


def _latency_rank(rank: int, folder: str, hidden: int, n: int, out: Any) -> None:
    """One of two processes timing all-reduces of one decode row ([1, hidden] fp32) on gloo."""
    from pathlib import Path

    from ruvllm.parallel.group import join_group

    torch.set_num_threads(1)
    group = join_group(Path(folder) / "rendezvous", rank, 2, torch.device("cpu"))
    x = torch.zeros(1, hidden)
    times = []
    for i in range(n + 50):
        start = time.perf_counter()
        group.all_reduce(x)
        if i >= 50:  # after a warm-up
            times.append(time.perf_counter() - start)
    if rank == 0:
        out.put((statistics.median(times), statistics.mean(times)))
    group.close()


def gloo_latency(hidden: int = 512, n: int = 1000) -> tuple[float, float]:
    """(median, mean) seconds of one all-reduce of a [1, hidden] fp32 row between two processes."""
    import tempfile

    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    out = ctx.SimpleQueue()
    with tempfile.TemporaryDirectory() as folder:
        procs = [ctx.Process(target=_latency_rank, args=(r, folder, hidden, n, out)) for r in range(2)]
        for p in procs:
            p.start()
        for p in procs:
            p.join()
        return out.get()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=24, help="decode steps per round")
    args = ap.parse_args()
    console = Console()
    table = Table(title="Step time, fp32, gloo on this CPU (medians over rounds)")
    for col in ("model", "setup", "prefill 128 tok (ms)", "decode, 1 seq (ms)", "decode, 8 seqs (ms)",
                "decode in collectives (1 / 8 seqs)", "collectives per decode step"):
        table.add_column(col, justify="left" if col in ("model", "setup") else "right")
    for name, cfg in MODELS.items():
        one_rank, two_ranks = _core(cfg, 1, 1), _core(cfg, 2, 2)  # TP=2: 2 threads in all, 1 per rank
        # (label, engine, rank 0's threads: torch's count is per process, so it is set before each run)
        setups = [("TP=1, 1 thread", one_rank, 1), ("TP=1, 2 threads", one_rank, 2),
                  ("TP=2, 1 thread/rank", two_ranks, 1)]
        clocks = {id(core): _CollectiveClock(core) for core in (one_rank, two_ranks)}
        results: dict[str, list[tuple]] = {label: [] for label, *_ in setups}
        for r in range(args.rounds):  # the setups take turns, so drift in the machine's load hits all
            for label, core, rank0_threads in setups:
                torch.set_num_threads(rank0_threads)
                clock = clocks[id(core)]
                one = _run(core, clock, cfg.vocab_size, 1, args.steps, f"{r}-1")
                eight = _run(core, clock, cfg.vocab_size, 8, args.steps, f"{r}-8")
                results[label].append((one[0], one[1], eight[1], one[2], eight[2], one[3]))
        for label, *_ in setups:
            med = [statistics.median(x) for x in zip(*results[label])]
            tp1 = label.startswith("TP=1")
            table.add_row(name, label, f"{med[0] * 1e3:.1f}", f"{med[1] * 1e3:.2f}", f"{med[2] * 1e3:.2f}",
                          "" if tp1 else f"{med[3]:.0%} / {med[4]:.0%}", "" if tp1 else f"{med[5]:.0f}")
        two_ranks.close()
    console.print(table)
    median, mean = gloo_latency()
    console.print(f"gloo all-reduce of one decode row ([1, 512] fp32) between two processes here: median "
                  f"{median * 1e6:.0f} us, mean {mean * 1e6:.0f} us (1000 calls)")


if __name__ == "__main__":
    main()
