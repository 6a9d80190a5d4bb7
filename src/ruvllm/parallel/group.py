"""The ranks' process groups, on torch.distributed, and the few collectives tensor parallelism uses.

Two groups over one rendezvous (a FileStore in a folder of rank 0's): a gloo group on the CPU for
rank 0's commands (step inputs: small integer tensors), and the device group for the activations
(the same gloo group on the CPU; NCCL on CUDA, where a rank waiting for its next command must not
sit in a GPU collective, which NCCL's watchdog would time out while the engine is idle).

The groups are ProcessGroup objects of this engine's own, not torch.distributed's default group:
two engines in one process (a test comparing sizes, a benchmark) each have their own, and nothing
global is set. The command group's timeout is effectively unbounded because a rank waits in it for
as long as the engine is idle; a rank that dies is noticed by its peers at once (gloo fails a
collective whose peer closed its connection) and a rank whose parent dies leaves by itself (ranks.py).
"""

from __future__ import annotations

import datetime
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

_FOREVER = datetime.timedelta(days=3650)
_DEVICE_TIMEOUT = datetime.timedelta(minutes=30)  # one collective within a step (NCCL)


class RankGroup:
    """This rank's view of the ranks: its number, their count, and the collectives."""

    def __init__(self, rank: int, size: int, store: dist.Store, control: dist.ProcessGroup,
                 device_group: dist.ProcessGroup) -> None:
        self.rank, self.size, self.store = rank, size, store
        self._control: dist.ProcessGroup | None = control
        self._device: dist.ProcessGroup | None = device_group

    def _groups(self) -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
        if self._control is None or self._device is None:
            raise RuntimeError("the tensor-parallel group is closed")
        return self._control, self._device

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum `t` over the ranks, in place (every rank gets the sum)."""
        self._groups()[1].allreduce([t]).wait()
        return t

    def gather_columns(self, t: torch.Tensor) -> torch.Tensor:
        """[R, C] on every rank -> [R, size * C]: rank r's columns at r * C (every rank gets them all)."""
        t = t.contiguous()
        out = t.new_empty(self.size * t.shape[0], t.shape[1])
        self._groups()[1]._allgather_base(out, t).wait()
        return out.view(self.size, t.shape[0], t.shape[1]).transpose(0, 1).reshape(t.shape[0], self.size * t.shape[1])

    def broadcast(self, t: torch.Tensor) -> torch.Tensor:
        """Rank 0's CPU tensor into `t` on every rank (the command group)."""
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        self._groups()[0].broadcast([t], opts).wait()
        return t

    def sum_ints(self, values: list[int]) -> list[int]:
        """Each value summed over the ranks (the command group: start-up handshakes)."""
        t = torch.tensor(values, dtype=torch.int64)
        self._groups()[0].allreduce([t]).wait()
        return t.tolist()

    def close(self) -> None:
        """Drop the groups now. (A gloo group destroyed during the interpreter's own teardown can
        abort the process, so whoever owns one ends it here, before exiting.)"""
        self._control = self._device = None


def join_group(rendezvous: Path, rank: int, size: int, device: torch.device,
               check_peers: Callable[[], None] | None = None) -> RankGroup:
    """Meet the other ranks at the `rendezvous` file and build the groups.

    Each rank first says it is there; rank 0 waits for all of them while `check_peers` can raise
    (a rank process that died while starting), since building a group would wait for them forever."""
    store = dist.FileStore(str(rendezvous), size)
    store.set(f"here/{rank}", "1")
    if check_peers is not None:
        keys = [f"here/{r}" for r in range(size)]
        while not store.check(keys):
            check_peers()
            time.sleep(0.02)
    opts = dist.ProcessGroupGloo._Options()
    opts._timeout = _FOREVER
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
    control = dist.ProcessGroupGloo(dist.PrefixStore("control/", store), rank, size, opts)
    if device.type == "cpu":
        return RankGroup(rank, size, store, control, control)
    if device.type != "cuda":
        raise ValueError(f"tensor parallelism runs on the CPU (gloo) or CUDA (NCCL), not {device.type}")
    torch.cuda.set_device(device)
    nccl_opts = dist.ProcessGroupNCCL.Options()
    nccl_opts._timeout = _DEVICE_TIMEOUT
    nccl = dist.ProcessGroupNCCL(dist.PrefixStore("device/", store), rank, size, nccl_opts)
    return RankGroup(rank, size, store, control, nccl)
