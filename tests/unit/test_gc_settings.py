"""gc_settings: a process's start runs without collections; at its end the start's cyclic garbage is
freed (never frozen), what lives on is frozen, and the collector runs again. In a fresh interpreter,
since both change process-wide state."""

from __future__ import annotations

import subprocess
import sys

SCRIPT = """
import gc, weakref
from ruvllm.gc_settings import defer_collection, startup_done

defer_collection()
assert not gc.isenabled()

class Node:
    pass

garbage = Node(); garbage.self = garbage  # a cycle only the collector frees
gone = weakref.ref(garbage)
del garbage
kept = [Node() for _ in range(1000)]
collected = [s["collections"] for s in gc.get_stats()]
import json, email.mime.text  # imports while deferred: no collection runs
assert [s["collections"] for s in gc.get_stats()] == collected, "a collection ran while deferred"
startup_done()
assert gc.isenabled()
assert gone() is None, "the start's cyclic garbage was frozen, not freed"
assert gc.get_freeze_count() >= len(kept)
print("ok")
"""


def test_a_start_defers_collection_then_frees_its_garbage_and_freezes_the_rest() -> None:
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr
