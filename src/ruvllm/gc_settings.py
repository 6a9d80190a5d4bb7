"""The cyclic garbage collector in ruvllm's own processes (the CLI, engine cores and their launcher,
tensor-parallel ranks, the grammar compiler's zygote): off while a process imports and loads, then
one collection, everything that survived frozen, and the collector back on. Importing ruvllm as a
library changes nothing: only those processes' entry points call these.

Why: CPython collects its youngest objects every 700 net container allocations, and every object
after ten of those once the long-lived ones grew by a quarter. Importing torch, transformers and the
server's libraries makes ~600,000 long-lived objects, so a starting process walked them all about
five times, and its young ones ~650 times: 1.1-1.3 s of CPU of a 4.6-4.8 s start (`import torch,
transformers, fastapi, openai` and the engine's modules; 0.4 s of 3.8 s with torch and the engine
alone; session 31, the 2-core EPYC). After the start, the frozen objects are never walked again: a
full collection, which took 0.2-0.6 s with them in a test worker (no engine step runs meanwhile),
walks only what the process made since.
"""

from __future__ import annotations

import atexit
import gc


def defer_collection() -> None:
    """No collection until `startup_done` (call it first thing: the imports are what it saves)."""
    gc.disable()


def startup_done() -> None:
    """The process has imported and loaded what it keeps: collect the start's garbage once (frozen
    garbage would never be freed), freeze the rest, collect as usual from here on. A forked child
    inherits the frozen objects unwalked, so its collections do not write their headers either, and
    the pages it shares with its parent stay shared (gc.freeze's documentation)."""
    gc.collect()
    gc.freeze()
    gc.enable()
    # At exit the frozen objects go back to the collector, for the interpreter's last collection as
    # before: frozen, extension objects were never freed, and nanobind (triton's bindings) reported
    # each as a leak. (Once, however often a process calls this.)
    atexit.unregister(gc.unfreeze)
    atexit.register(gc.unfreeze)
