"""The learning threads' lower CPU priority (a thread's own nice value on Linux, the rest of the
process untouched) and their names as the OS shows them."""

from __future__ import annotations

import os
import sys
import threading

import pytest

from ruvllm.learning.background import BackgroundLoop, learning_thread


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread nice values are Linux's")
def test_only_the_calling_thread_is_lowered() -> None:
    before = os.getpriority(os.PRIO_PROCESS, 0)
    if before >= 19:
        pytest.skip("this process already runs at the lowest priority")
    target = min(19, before + 5)
    seen: list[object] = []

    def work() -> None:
        learning_thread("ruvllm-test-learning-thread", target)
        tid = threading.get_native_id()
        seen.append(os.getpriority(os.PRIO_PROCESS, tid))
        seen.append(open(f"/proc/self/task/{tid}/comm").read().strip())

    t = threading.Thread(target=work)
    t.start()
    t.join()
    # the OS keeps 15 bytes of a thread's name
    assert seen == [target, "ruvllm-test-lea"] and os.getpriority(os.PRIO_PROCESS, 0) == before
    assert open(f"/proc/self/task/{threading.get_native_id()}/comm").read().strip() != "ruvllm-test-lea"


def test_the_background_loop_runs_after_a_notice_and_stops() -> None:
    ran = threading.Event()
    loop = BackgroundLoop(ran.set, interval_s=0.01, nice=3)
    assert not ran.wait(0.1)  # nothing pending: no pass
    loop.notify()
    assert ran.wait(5)
    loop.close()
    assert loop.runs == 1
