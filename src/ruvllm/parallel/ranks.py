"""Rank 0's side of tensor parallelism: the other ranks' processes, from start to stop.

The engine's worker is rank 0, in whatever process runs the engine core (the caller's for `LLM`, the
core process for `ruvllm serve`, each replica's under data parallelism). It starts ranks 1..N-1 as
child processes of its own (`python -m ruvllm.parallel.rank_process`, a fresh interpreter, each with
its RankSpec pickled on stdin), meets them at a rendezvous file in a private folder, loads its own
slice while they load theirs, and checks in one all-reduce that every rank loaded (a rank that failed
leaves its error in the rendezvous store; rank 0 raises it).

Stopping: `close()` sends the others Stop, waits for them, then terminates and kills what is left,
and always reaps them; it also runs when the worker is garbage-collected and at interpreter exit. A
rank whose parent dies (rank 0's process killed) sees its parent change and exits, and one blocked
in a collective with a rank that died gets gloo's "connection closed" and exits: no rank outlives
the engine. A rank that dies mid-run fails rank 0's next step with a message naming it.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import pickle
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ruvllm.config import DEFAULT_CPU_KV_CACHE_BYTES, CacheConfig, EngineConfig, ModelConfig
from ruvllm.device import default_num_threads
from ruvllm.errors import ModelLoadError
from ruvllm.models.registry import weight_bytes
from ruvllm.models.weight_plan import WeightPlan
from ruvllm.parallel.group import RankGroup, join_group
from ruvllm.parallel.layers import TensorParallelLlama
from ruvllm.parallel.shard import LeaderRunner, RankSpec, build_shard_model
from ruvllm.parallel.sharding import Weights
from ruvllm.parallel.step_inputs import CommandSender
from ruvllm.parallel.support import check_tensor_parallel
from ruvllm.reaping import reap

log = logging.getLogger(__name__)

_STOP_WAIT_S = 10.0
_JOIN_TIMEOUT_S = 300.0  # a rank process that neither joins nor dies in this time is taken as hung


def rank_threads(config: EngineConfig) -> int:
    """CPU threads of each rank: the engine's threads (num_threads, else as default_num_threads
    counts them) split evenly among its ranks, at least one each."""
    return max(1, (config.num_threads or default_num_threads()) // config.tensor_parallel_size)


def rank_device(device: torch.device, rank: int) -> str:
    """Rank r's device: the CPU, or the GPU r places after rank 0's."""
    return "cpu" if device.type == "cpu" else f"cuda:{(device.index or 0) + rank}"


@dataclass
class _Processes:
    """What stopping needs (kept apart from TensorParallelRanks so its finalizer holds no cycle)."""

    folder: Path
    procs: list[subprocess.Popen] = field(default_factory=list)
    group: RankGroup | None = None
    running: bool = False  # every rank loaded and follows commands: Stop can be sent

    def gone(self, wait: float = 0.0) -> str | None:
        """Which rank process has exited, if any; `wait`: give one that is dying that long to be reaped."""
        deadline = time.monotonic() + wait
        while True:
            for rank, p in enumerate(self.procs, start=1):
                code = p.poll()
                if code is not None:
                    return f"tensor-parallel rank {rank} exited (exit code {code})"
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.05)

    def out_of_step(self) -> None:
        """Rank 0 left a call half-made: the others wait inside it, so Stop would not reach them."""
        self.running = False

    def stop(self) -> None:
        asked = 0.0  # how long the ranks get to leave by themselves
        if self.running and self.group is not None and self.gone() is None:
            try:
                CommandSender(self.group).stop()
                asked = _STOP_WAIT_S
            except RuntimeError:
                pass  # a rank already gone: the others are terminated below
        self.running = False
        for p in self.procs:
            reap(p, asked)
        if self.group is not None:
            self.group.close()
        shutil.rmtree(self.folder, ignore_errors=True)


class TensorParallelRanks:
    """Rank 0's slice of the model and the other ranks behind it (see the module's docstring)."""

    def __init__(self, config: EngineConfig, mc: ModelConfig, plan: WeightPlan, device: torch.device,
                 max_model_len: int, weights: Weights, source: str) -> None:
        check_tensor_parallel(config, mc, plan, device, source)
        self.size = config.tensor_parallel_size
        self._procs = _Processes(Path(tempfile.mkdtemp(prefix="ruvllm-tp-")))
        self._finalizer = weakref.finalize(self, self._procs.stop)
        spec = RankSpec(model=mc, weights=weights, source=source, size=self.size, rank=0, device=str(device),
                        dtype=plan.dtype, quant=plan.quant, max_model_len=max_model_len,
                        block_size=config.cache.block_size, attention=config.attention, seed=config.seed,
                        threads=rank_threads(config), rendezvous=self._procs.folder / "rendezvous")
        self.layout = spec.layout
        try:
            self._start_ranks(spec)
            self._join_deadline = time.monotonic() + _JOIN_TIMEOUT_S
            group = self._procs.group = join_group(spec.rendezvous, 0, self.size, device, self._check_started)
            self.model: TensorParallelLlama = build_shard_model(spec, group)
            try:
                loaded, total_bytes = group.sum_ints([1, weight_bytes(self.model)])
            except RuntimeError as exc:  # a rank died while loading: gloo saw its connection close
                raise ModelLoadError(f"{self._procs.gone(wait=2.0) or 'a tensor-parallel rank failed'} while "
                                     f"loading ({exc})") from exc
            if loaded < self.size:
                raise ModelLoadError(self._load_failures(group))
        except BaseException:
            self.close()
            raise
        self.group = group
        self.weight_bytes = total_bytes  # every rank's
        self._procs.running = True
        log.info("tensor parallelism: %d ranks (%s), %d query heads and %d KV heads%s per rank", self.size,
                 "gloo" if device.type == "cpu" else "NCCL", self.layout.heads, self.layout.kv_heads,
                 " (replicated)" if self.layout.kv_replicated else "")

    def _start_ranks(self, spec: RankSpec) -> None:
        env = {**os.environ, "RUVLLM_LOG": str(logging.getLogger().getEffectiveLevel()),
               "OMP_NUM_THREADS": str(spec.threads)}
        for rank in range(1, self.size):
            rank_spec = dataclasses.replace(spec, rank=rank, device=rank_device(torch.device(spec.device), rank))
            try:
                data = pickle.dumps(rank_spec)
            except (pickle.PicklingError, AttributeError, TypeError) as exc:
                raise ValueError("tensor parallelism starts a process per rank, which must rebuild the weights: "
                                 "weights from code need a function that pickles (a module-level function "
                                 f"or a functools.partial of one), not {spec.weights!r} ({exc})") from exc
            # Linux's parent-death signal follows the thread that forks: only a main thread's start may ask
            # for it (an engine built on a thread that then ends would take its ranks down with it).
            started_by = ["main-thread"] if threading.current_thread() is threading.main_thread() else []
            proc = subprocess.Popen([sys.executable, "-m", "ruvllm.parallel.rank_process", str(os.getpid()),
                                     *started_by], stdin=subprocess.PIPE, env=env)
            self._procs.procs.append(proc)
            assert proc.stdin is not None
            proc.stdin.write(data)
            proc.stdin.close()

    def _check_started(self) -> None:
        gone = self._procs.gone()
        if gone is not None:
            raise ModelLoadError(f"{gone} before joining the others")
        if time.monotonic() > self._join_deadline:
            raise ModelLoadError(f"tensor-parallel ranks did not start within {_JOIN_TIMEOUT_S:.0f} s")

    def _load_failures(self, group: RankGroup) -> str:
        errors = []
        for rank in range(1, self.size):
            key = f"failed/{rank}"
            if group.store.check([key]):
                errors.append(f"rank {rank}: {group.store.get(key).decode()}")
        return "tensor-parallel ranks failed to load: " + ("; ".join(errors) or "(no error was recorded)")

    # --- what the worker builds its runner from ---------------------------------------------------
    @property
    def local_config(self) -> ModelConfig:
        return self.layout.local_config()

    def rank_cache(self, cache: CacheConfig) -> CacheConfig:
        """The KV settings one rank sizes its pool by: a memory budget is the engine's, shared by its ranks."""
        if cache.num_blocks is not None or (cache.kv_cache_memory_bytes is None and self.model_device_is_cuda):
            return cache
        budget = cache.kv_cache_memory_bytes or DEFAULT_CPU_KV_CACHE_BYTES
        return dataclasses.replace(cache, kv_cache_memory_bytes=max(1, budget // self.size))

    @property
    def model_device_is_cuda(self) -> bool:
        return self.model.norm.weight.device.type == "cuda"

    def runner_class(self) -> functools.partial[LeaderRunner]:
        return functools.partial(LeaderRunner, commands=CommandSender(self.group),
                                 rank_failure=functools.partial(self._procs.gone, wait=1.0),
                                 on_out_of_step=self._procs.out_of_step)

    def close(self) -> None:
        """Stop the other ranks (Stop, then terminate, then kill) and reap them; idempotent."""
        self._finalizer()
