"""A tensor-parallel rank other than 0: join, load this rank's slice, then follow rank 0's commands.

Started by rank 0 (ranks.py) as `python -m ruvllm.parallel.rank_process PARENT_PID` with its
RankSpec pickled on stdin. It leaves when told to stop, when a collective fails (rank 0 or another
rank died), or when its parent is gone: at once where the kernel can say so (Linux's parent-death
signal, asked for when a main thread started it), else within half a second (a thread of its own checks
the parent, since the main thread may be blocked in a collective).
"""

from __future__ import annotations

import ctypes
import logging
import os
import pickle
import signal
import sys
import threading
import time

log = logging.getLogger("ruvllm.rank")


_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """SIGKILL from the kernel the moment the parent dies. The signal follows the parent's thread that
    started this process, so rank 0 asks for it only when its main thread did (argv). A check after
    asking: a parent that died before it was asked for is caught by the watch thread at once."""
    prctl = getattr(ctypes.CDLL(None), "prctl", None)
    if prctl is not None:
        prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def _leave_when_orphaned(parent_pid: int) -> None:
    # The watch thread stays where the signal is asked for too: it covers a parent that died before the
    # request, and systems without prctl. On a host loaded to 8 runnable jobs a core (2026-11-27) one rank
    # outlived its killed core for over 5 s with this thread alone; with the signal the kernel ends it.
    if os.getppid() != parent_pid:
        os._exit(1)
    while True:
        time.sleep(0.5)
        if os.getppid() != parent_pid:
            os._exit(1)  # no clean-up to wait for: the engine this rank served is gone


def main(parent_pid: int, started_by_main_thread: bool = False) -> int:
    if started_by_main_thread:
        _die_with_parent()
    from ruvllm.gc_settings import defer_collection, startup_done

    defer_collection()
    # Ctrl-C reaches the whole process group; rank 0 decides when the ranks stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    level = os.environ.get("RUVLLM_LOG", "WARNING").upper()
    logging.basicConfig(level=int(level) if level.isdigit() else level,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    threading.Thread(target=_leave_when_orphaned, args=(parent_pid,), name="ruvllm-rank-watch", daemon=True).start()
    spec = pickle.loads(sys.stdin.buffer.read())

    import torch

    from ruvllm.models.registry import weight_bytes
    from ruvllm.parallel.group import join_group
    from ruvllm.parallel.shard import FollowerRunner, build_shard_model

    torch.set_num_threads(spec.threads)
    device = torch.device(spec.device)
    group = join_group(spec.rendezvous, spec.rank, spec.size, device)
    runner = None
    try:
        model = build_shard_model(spec, group)
        # One block until rank 0 sizes the pool (its runner announces the size when it is built).
        runner = FollowerRunner(model, spec.layout.local_config(), spec.block_size, 1, spec.dtype, device,
                                seed=spec.seed, attention=spec.attention)
        status = [1, weight_bytes(model)]
    except Exception as exc:
        log.exception("tensor-parallel rank %d failed to load", spec.rank)
        group.store.set(f"failed/{spec.rank}", f"{type(exc).__name__}: {exc}")
        status = [0, 0]
    code = 1
    try:
        group.sum_ints(status)
        startup_done()
        if runner is not None:
            runner.follow(group)
            code = 0
    except RuntimeError as exc:  # rank 0 (or another rank) is gone
        log.info("tensor-parallel rank %d leaves: %s", spec.rank, exc)
    group.close()
    return code


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1]), sys.argv[2:] == ["main-thread"]))
