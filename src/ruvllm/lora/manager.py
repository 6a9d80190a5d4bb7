"""The adapters one engine serves: each read from its folder, checked against the model, and
copied into a slot of the preallocated LoraSlots; and each step's rows mapped to their slots."""

from __future__ import annotations

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
        self._loaded: dict[str, tuple[int, LoraAdapter]] = {}  # name -> (slot, adapter)

    def read(self, name: str, path: str | Path) -> LoraAdapter:
        """Read and check an adapter (file work only: no slot is touched)."""
        return load_peft_adapter(path, self.cfg, self.config.max_lora_rank, name)

    def install(self, adapter: LoraAdapter) -> int:
        """Copy a read adapter into a free slot; returns the slot."""
        if adapter.name in self._loaded:
            raise AdapterError(f"an adapter named {adapter.name!r} is already loaded")
        used = {slot for slot, _ in self._loaded.values()}
        free = next((s for s in range(self.config.max_loras) if s not in used), None)
        if free is None:
            raise AdapterError(f"all {self.config.max_loras} adapter slots are in use (--max-loras); "
                               "unload an adapter first")
        self.slots.load(free, adapter)
        self._loaded[adapter.name] = (free, adapter)
        return free

    def remove(self, name: str) -> None:
        slot, _ = self._loaded.pop(name)
        self.slots.clear(slot)

    def names(self) -> list[str]:
        return list(self._loaded)

    def batch(self, so: SchedulerOutput) -> LoraBatch | None:
        """The step's rows and their slots, or None when no row uses an adapter."""
        if not any(seq.adapter for seq in so.seqs):
            return None
        rows: list[int] = []
        for seq in so.seqs:
            slot = self._loaded[seq.adapter][0] if seq.adapter else -1
            rows.extend([slot] * len(seq.token_ids))
        return LoraBatch(self.slots, rows, self.kernel)
