"""The background loop: a thread that runs `Learner.consolidate()` while instant updates are
pending, at most once every `interval_s` (the seed's ~100 ms), so that EWC++'s Fisher refresh and
pull never lengthen a feedback request."""

from __future__ import annotations

import ctypes
import logging
import os
import threading
import time
from typing import Callable

_log = logging.getLogger(__name__)


def learning_thread(name: str, nice: int) -> None:
    """Set up the calling thread as one that learns: its name as the OS shows it (`top -H`, `ps -L`,
    perf; what benchmarks/learning_cost.py reads to tell the learner's CPU from serving's), and a
    lower CPU priority (Linux: a thread's nice value is its own), so that on a machine with few
    cores learning takes what serving leaves rather than half of it. Elsewhere, or without
    permission, each stays as it is."""
    try:
        libc = ctypes.CDLL(None)
        libc.prctl(15, ctypes.c_char_p(name.encode()[:15]), 0, 0, 0)  # PR_SET_NAME (Linux; 15 bytes)
    except (OSError, AttributeError):
        pass
    if nice <= 0 or not hasattr(os, "setpriority"):
        return
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, max(os.getpriority(os.PRIO_PROCESS, tid), nice))
    except OSError:
        pass


class BackgroundLoop:
    def __init__(self, consolidate: Callable[[], object], interval_s: float, nice: int = 0) -> None:
        self._consolidate, self.interval_s, self.nice = consolidate, interval_s, nice
        self._wake, self._stop = threading.Event(), threading.Event()
        self.runs = 0
        self._thread = threading.Thread(target=self._run, name="ruvllm-learning-background", daemon=True)
        self._thread.start()

    def notify(self) -> None:
        """An instant update happened: consolidate within `interval_s`."""
        self._wake.set()

    def close(self) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join()

    def _run(self) -> None:
        learning_thread("ruvllm-consol", self.nice)
        last = 0.0
        while True:
            self._wake.wait()
            if self._stop.is_set():
                return
            # updates arriving meanwhile are consolidated together: one pass per interval at most
            self._stop.wait(max(0.0, last + self.interval_s - time.monotonic()))
            if self._stop.is_set():
                return
            self._wake.clear()
            last = time.monotonic()
            try:
                self._consolidate()
                self.runs += 1
            except Exception:  # noqa: BLE001  # one failed pass must not end learning for everyone
                _log.exception("background consolidation failed")
