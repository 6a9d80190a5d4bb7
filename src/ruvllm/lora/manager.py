"""The adapters one engine serves: each read from its folder, checked against the model and kept
in CPU memory (up to max_cpu_loras); the ones a step uses are copied into slots of the
preallocated LoraSlots on demand (up to max_loras, the scheduler never mixes more in one batch),
evicting the least recently used adapter that the step does not need."""

from __future__ import annotations

import threading
from pathlib import Path

import torch

from ruvllm.config import LoraConfig, ModelConfig
from ruvllm.errors import AdapterError
from ruvllm.lora.batch import LoraBatch, lora_kernel
from ruvllm.lora.peft_adapter import LoraAdapter, load_peft_adapter
from ruvllm.lora.slots import LoraSlots
from ruvllm.outputs import SchedulerOutput


class LoraManager:
    def __init__(self, cfg: ModelConfig, config: LoraConfig, dtype: torch.dtype, device: torch.device) -> None:
        self.cfg, self.config = cfg, config
        self.slots = LoraSlots(cfg, config.max_loras, config.max_lora_rank, dtype, device)
        self.kernel = lora_kernel() if device.type == "cpu" else None
        self._loaded: dict[str, LoraAdapter] = {}
        self._lock = threading.Lock()  # install runs on a load's own thread, remove on the loop's
        self._slot_of: dict[str, int] = {}  # resident adapters, least recently used first

    def read(self, name: str, path: str | Path) -> LoraAdapter:
        """Read and check an adapter (file work only: no slot is touched)."""
        return load_peft_adapter(path, self.cfg, self.config.max_lora_rank, name)

    def install(self, adapter: LoraAdapter) -> None:
        """Keep a read adapter ready to serve (it takes a slot when a step first uses it)."""
        with self._lock:
            if adapter.name in self._loaded:
                raise AdapterError(f"an adapter named {adapter.name!r} is already loaded")
            if len(self._loaded) >= self.config.cpu_capacity:
                raise AdapterError(f"{len(self._loaded)} adapters are loaded, the most this server keeps "
                                   "(--max-cpu-loras); unload one first")
            self._loaded[adapter.name] = adapter

    def remove(self, name: str) -> None:
        with self._lock:
            del self._loaded[name]
        slot = self._slot_of.pop(name, None)
        if slot is not None:
            self.slots.clear(slot)

    def names(self) -> list[str]:
        return list(self._loaded)

    def resident(self) -> dict[str, int]:
        return dict(self._slot_of)

    def _slot_for(self, name: str, needed: set[str]) -> int:
        """The adapter's slot, copying it in first if it has none: into a free slot, else over the
        least recently used adapter this step does not need."""
        slot = self._slot_of.pop(name, None)
        if slot is None:
            taken = set(self._slot_of.values())
            slot = next((s for s in range(self.config.max_loras) if s not in taken), None)
            if slot is None:
                victim = next((n for n in self._slot_of if n not in needed), None)
                if victim is None:
                    raise AdapterError(f"a step needs more than {self.config.max_loras} adapters (--max-loras)")
                slot = self._slot_of.pop(victim)
            self.slots.load(slot, self._loaded[name])
        self._slot_of[name] = slot  # most recently used last
        return slot

    def batch(self, so: SchedulerOutput) -> LoraBatch | None:
        """The step's rows and their slots, or None when no row uses an adapter."""
        needed = {seq.adapter for seq in so.seqs if seq.adapter}
        if not needed:
            return None
        slots = {name: self._slot_for(name, needed) for name in needed}
        rows: list[int] = []
        for seq in so.seqs:
            rows.extend([slots[seq.adapter] if seq.adapter else -1] * len(seq.token_ids))
        return LoraBatch(self.slots, rows, self.kernel)
