"""The adapters one engine serves: each read from its folder, checked against the model and kept
in CPU memory (up to max_cpu_loras); the ones a step uses are copied into slots of the
preallocated LoraSlots on demand (up to max_loras, the scheduler never mixes more in one batch),
evicting the least recently used adapter that the step does not need. An X-LoRA model takes one
slot per adapter it mixes."""

from __future__ import annotations

import threading
from pathlib import Path

import torch

from ruvllm.config import LoraConfig, ModelConfig
from ruvllm.errors import AdapterError
from ruvllm.lora.batch import LoraBatch, XLoraBatch, lora_kernel
from ruvllm.lora.checked_files import CheckedFiles
from ruvllm.lora.peft_adapter import LoraAdapter, load_peft_adapter
from ruvllm.lora.slots import FUSED, LoraSlots
from ruvllm.lora.xlora import XLoraAdapter, is_xlora_folder, load_xlora
from ruvllm.outputs import ScheduledSeq, SchedulerOutput

Served = LoraAdapter | XLoraAdapter
SlotKey = tuple[str, int]  # (served name, expert index; -1 for a plain adapter)


class LoraManager:
    def __init__(self, cfg: ModelConfig, config: LoraConfig, dtype: torch.dtype, device: torch.device) -> None:
        self.cfg, self.config = cfg, config
        self.slots = LoraSlots(cfg, config.max_loras, config.max_lora_rank, dtype, device)
        self.kernel = lora_kernel() if device.type == "cpu" else None
        self._loaded: dict[str, Served] = {}
        self._lock = threading.Lock()  # install runs on a load's own thread, remove on the loop's
        self._slot_of: dict[SlotKey, int] = {}  # resident adapters, least recently used first

    def read(self, name: str, path: str | Path, checked: CheckedFiles | None = None) -> Served:
        """Read and check an adapter or an X-LoRA model (file work only: no slot is touched); `checked`:
        the files the server's path policy checked, the only ones read then (lora/checked_files.py)."""
        if is_xlora_folder(path, checked):
            return load_xlora(path, self.cfg, self.config.max_lora_rank, name, checked)
        return load_peft_adapter(path, self.cfg, self.config.max_lora_rank, name, checked)

    def install(self, adapter: Served) -> None:
        """Keep a read adapter's weights ready to serve (it takes a slot when a step first uses it).
        Whether it may be added (its name, size, the capacity) is the core's AdapterRegistry's call."""
        with self._lock:
            self._loaded[adapter.name] = adapter

    def remove(self, name: str) -> None:
        with self._lock:
            del self._loaded[name]
        for key in [k for k in self._slot_of if k[0] == name]:
            self.slots.clear(self._slot_of.pop(key))

    def names(self) -> list[str]:
        return list(self._loaded)

    def resident(self) -> dict[SlotKey, int]:
        return dict(self._slot_of)

    def get(self, name: str) -> Served:
        return self._loaded[name]

    def _keys(self, name: str) -> list[SlotKey]:
        served = self._loaded[name]
        return [(name, i) for i in range(len(served.adapters))] if isinstance(served, XLoraAdapter) else [(name, -1)]

    def _slot_for(self, key: SlotKey, needed: set[SlotKey]) -> int:
        """The adapter's slot, copying it in first if it has none: into a free slot, else over the
        least recently used adapter this step does not need."""
        slot = self._slot_of.pop(key, None)
        if slot is None:
            taken = set(self._slot_of.values())
            slot = next((s for s in range(self.config.max_loras) if s not in taken), None)
            if slot is None:
                victim = next((n for n in self._slot_of if n not in needed), None)
                if victim is None:
                    raise AdapterError(f"a step needs more than {self.config.max_loras} adapters (--max-loras)")
                slot = self._slot_of.pop(victim)
            served = self._loaded[key[0]]
            self.slots.load(slot, served.adapters[key[1]] if isinstance(served, XLoraAdapter) else served)
        self._slot_of[key] = slot  # most recently used last
        return slot

    def batch(self, so: SchedulerOutput) -> LoraBatch | None:
        """The step's first forward pass: each row's slot (the base model for X-LoRA rows: their
        scaling pass), or None when no row uses an adapter there. Every adapter the step uses, X-LoRA
        experts included, is made resident here, for both passes."""
        needed = {key for seq in so.seqs for name in _names(seq) for key in self._keys(name)}
        if not needed:
            return None
        slots = {key: self._slot_for(key, needed) for key in needed}
        depth = max(len(seq.stacked) for seq in so.seqs)
        levels: list[list[int]] = [[] for _ in range(1 + depth)]  # named (or learned alone), then stacked
        for seq in so.seqs:
            plain = seq.adapter and seq.scaling_block_table is None  # X-LoRA rows: their stack comes in pass 2
            names = [seq.adapter, *seq.stacked] if plain else []
            for d, level in enumerate(levels):
                level.extend([slots[(names[d], -1)] if d < len(names) else -1] * len(seq.token_ids))
        levels = [level for level in levels if any(r != -1 for r in level)]
        if not levels:
            return None
        return LoraBatch(self.slots, levels[0], self.kernel, levels[1:])

    def xlora_batch(self, seqs: list[ScheduledSeq], hidden: torch.Tensor) -> XLoraBatch:
        """The real pass of X-LoRA sequences (resident since batch()), from their rows' scaling-pass
        hidden states [T, H] in the order of `seqs`."""
        served = [self._loaded[seq.adapter] for seq in seqs]
        width = max(len(m.adapters) for m in served)
        T = hidden.shape[0]
        hidden = hidden.float().cpu()  # the classifiers are float32 on the CPU
        member_slots = [[-1] * T for _ in range(width)]
        stacked = [[-1] * T for _ in range(max(len(seq.stacked) for seq in seqs))]
        weights = torch.zeros(self.cfg.num_layers, len(FUSED), width, T, 3)
        start = 0
        for seq, model in zip(seqs, served):
            n = len(seq.token_ids)
            assert isinstance(model, XLoraAdapter)
            for k in range(len(model.adapters)):
                member_slots[k][start:start + n] = [self._slot_of[(model.name, k)]] * n
            for d, name in enumerate(seq.stacked):  # after the mixture, in order (resident since batch())
                stacked[d][start:start + n] = [self._slot_of[(name, -1)]] * n
            # each (layer, fused projection, sub-projection)'s module, or the zero column past the last
            gather = model.gather
            scalings = model.classifier.scalings(hidden[start:start + n]) * model.classifier.settings.global_scaling_weight
            padded = torch.cat([scalings, scalings.new_zeros(n, 1, scalings.shape[2])], dim=1)
            mixed = padded[:, gather.flatten(), :].view(n, *gather.shape, -1)  # [n, L, F, 3, A]
            weights[:, :, :len(model.adapters), start:start + n, :] = mixed.permute(1, 2, 4, 0, 3)
            start += n
        # one contiguous [k, T, n_sub] per (layer, projection), on the slots' device: the kernel takes w[k] as it is
        device = self.slots.layers[0]["o"].A.device
        per_projection = {(layer, fused): weights[layer, f, :, :, :len(subs)].contiguous().to(device)
                          for layer in range(self.cfg.num_layers) for f, (fused, subs) in enumerate(FUSED.items())}
        return XLoraBatch(self.slots, member_slots, per_projection, self.kernel, stacked)


def _names(seq: ScheduledSeq) -> tuple[str, ...]:
    """The adapters a sequence runs with, in the order their deltas are added."""
    return (seq.adapter, *seq.stacked) if seq.adapter else ()
