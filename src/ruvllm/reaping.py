"""Stopping a child process for certain: the engine's core processes and tensor-parallel ranks alike."""

from __future__ import annotations

import subprocess

# How long a child gets after SIGTERM, then after SIGKILL: enough to write its last message.
_GRACE_S = 5.0


def reap(proc: subprocess.Popen, asked_s: float = 0.0) -> None:
    """Join `proc` however it ends: it was asked to leave (`asked_s` seconds to do so; 0 when it was
    not asked, or cannot read the request yet), then SIGTERM, then SIGKILL. No zombie is left."""
    for stop, wait in ((None, asked_s), (proc.terminate, _GRACE_S), (proc.kill, _GRACE_S)):
        if stop is not None:
            stop()
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue
