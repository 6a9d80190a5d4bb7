"""The engine's one record of its LoRA adapters: which names are loaded, under which load id, what
each asks of a step, how many requests hold it, and which are waiting to be unloaded.

The worker keeps only the weights (by name); everything a caller can be refused for is decided
here. Loads happen on a thread of their own while the loop steps, so every method takes the lock.

A request holds an ordered tuple of runs: the adapter it names, then any stacked on it (its tenant's
learned micro-LoRA, docs/adapters.md "Stacking"). It holds each of them, so an unload of any waits
for it.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable
from dataclasses import dataclass

from ruvllm.errors import AdapterCapacityError, AdapterError, AdapterNotFoundError
from ruvllm.messages import AdapterEntry


@dataclass(frozen=True)
class AdapterRun:
    """What a request's adapter asks of the scheduler: its slots (an X-LoRA model takes one per
    adapter it mixes) and whether it runs a scaling pass, with a KV stream of its own. `load_id`
    salts the prefix cache: a name loaded again is another adapter, whose blocks are never a hit
    for the old one's."""

    name: str
    load_id: int
    slots: int = 1
    scaling_pass: bool = False


@dataclass
class _Entry:
    run: AdapterRun
    path: str
    refs: int = 0  # requests in the core that use it
    unloading: bool = False  # refused to new requests; removed when refs reaches 0


class AdapterRegistry:
    def __init__(self, max_loras: int, cpu_capacity: int) -> None:
        self.max_loras, self.cpu_capacity = max_loras, cpu_capacity
        self._entries: dict[str, _Entry] = {}
        self._load_ids = itertools.count()
        self._lock = threading.Lock()

    def check_new(self, name: str) -> None:
        """AdapterError when no adapter of this name can be added now (checked before its file is read)."""
        with self._lock:
            self._check_new(name)

    def _check_new(self, name: str) -> None:
        if name in self._entries:
            raise AdapterError(f"an adapter named {name!r} is already loaded")
        if len(self._entries) >= self.cpu_capacity:
            raise AdapterCapacityError(f"{len(self._entries)} adapters are loaded, the most this server keeps "
                               "(--max-cpu-loras); unload one first")

    def add(self, name: str, path: str, slots: int, scaling_pass: bool,
            install: Callable[[], None] = lambda: None) -> AdapterRun:
        """Register an adapter; `install` (a callable) runs under the lock first, so the worker
        holds the weights before any request can name it."""
        with self._lock:
            self._check_new(name)
            if slots > self.max_loras:
                raise AdapterError(f"{name!r} mixes {slots} adapters and this engine has {self.max_loras} "
                                   "adapter slots (--max-loras)")
            install()
            run = AdapterRun(name, next(self._load_ids), slots, scaling_pass)
            self._entries[name] = _Entry(run, path)
            return run

    def acquire(self, name: str) -> AdapterRun:
        """A new request's hold on a servable adapter (AdapterNotFoundError when none is)."""
        with self._lock:
            entry = self._entries.get(name)
            if entry is None or entry.unloading:
                raise AdapterNotFoundError(f"no adapter named {name!r} is loaded", param="model")
            entry.refs += 1
            return entry.run

    def acquire_stack(self, names: tuple[str, ...]) -> tuple[AdapterRun, ...]:
        """A new request's holds on the adapters it runs with, in the order their deltas are added:
        all of them or none (AdapterNotFoundError names the first that is not servable). A stack
        that needs more slots than the engine has is run without the adapters that do not fit (an
        X-LoRA model using every slot keeps its mixture, without the tenant's micro-LoRA): it could
        never be scheduled otherwise. Only plain adapters stack on another."""
        with self._lock:
            entries = [self._entries.get(name) for name in names]
            for name, entry in zip(names, entries):
                if entry is None or entry.unloading:
                    raise AdapterNotFoundError(f"no adapter named {name!r} is loaded", param="model")
            runs: list[AdapterRun] = []
            for i, entry in enumerate(entries):
                assert entry is not None
                fits = sum(r.slots for r in runs) + entry.run.slots <= self.max_loras
                if i == 0 or (fits and not entry.run.scaling_pass and entry.run.name not in {r.name for r in runs}):
                    entry.refs += 1
                    runs.append(entry.run)
            return tuple(runs)

    def release(self, run: AdapterRun) -> bool:
        """A request let go of its adapter: True when that was the last hold of one being unloaded
        (the caller removes it: `drop`)."""
        with self._lock:
            entry = self._entries.get(run.name)
            if entry is None or entry.run is not run:
                return False
            entry.refs -= 1
            return entry.unloading and entry.refs == 0

    def unload(self, name: str) -> bool:
        """Refuse it to new requests: True when nothing holds it (the caller removes it now)."""
        with self._lock:
            entry = self._entries.get(name)
            if entry is None or entry.unloading:
                raise AdapterError(f"no adapter named {name!r} is loaded")
            entry.unloading = True
            return entry.refs == 0

    def drop(self, name: str) -> None:
        with self._lock:
            del self._entries[name]

    def names(self) -> list[str]:
        """The adapters new requests may use."""
        with self._lock:
            return [name for name, e in self._entries.items() if not e.unloading]

    def entries(self) -> list[AdapterEntry]:
        with self._lock:
            return [AdapterEntry(name, e.path) for name, e in self._entries.items() if not e.unloading]
