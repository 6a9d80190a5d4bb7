"""X-LoRA (peft's `XLoraConfig` format): several LoRA adapters mixed per token by a small classifier.

A *scaling pass* (the base model: we run only `scaling_pass_value` 0, adapters off) gives each
token's final hidden state; the classifier (`xlora_depth` linears, ReLU between) turns it into one
logit per adapter, or one per adapter and per adapted module with `layerwise_scalings`; softmax with
`softmax_temperature`, optional top-k (renormalized by a softmax over the kept ones with
`enable_softmax_topk`). The real pass then adds, in every adapted module, the sum over adapters of
`B_a A_a x * s_a * global_scaling_weight`, s_a being the token's scaling for that module.

peft 0.21.2's checkpoint, read here as peft's loader reads it: `adapter_config.json` (peft_type
XLORA) names the adapters' folders (`adapters`: name -> path), from which the experts are loaded;
the top-level safetensors holds the classifier's last linear. The subfolders peft's save writes
beside it ("0/", "1/"...) are not the adapters: its save keeps in subfolder n only the tensors whose
key contains ".n" (adapter n's LoRA pairs of decoder layer n, copies of base tensors, the
classifier's first linear renamed `layers.weight` in "0/"), so they are read only for that first
linear. `ruvllm xlora train` writes the whole classifier to the top-level file, which peft's loader
reads too (peft's own save alone does not reload the first linear).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from ruvllm.config import ModelConfig
from ruvllm.errors import AdapterError
from ruvllm.layers.dense import dense_linear
from ruvllm.lora.slots import FUSED
from ruvllm.lora.checked_files import CheckedFiles
from ruvllm.lora.peft_adapter import (TARGETS, LoraAdapter, checked_folder, load_peft_adapter, read_adapter_config,
                                      read_adapter_tensors)

_CLASSIFIER = "base_model.internal_xlora_classifier.layers."


@dataclass(frozen=True)
class XLoraSettings:
    """The classifier's and the mixture's settings, as peft's XLoraConfig names them."""

    hidden_size: int
    enable_softmax: bool = True
    enable_softmax_topk: bool = False
    layerwise_scalings: bool = False
    xlora_depth: int = 1
    xlora_size: int = 2048
    xlora_dropout_p: float = 0.2
    softmax_temperature: float = 1.0
    top_k_lora: int | None = None
    scaling_pass_value: float = 0.0
    global_scaling_weight: float = 1.0

    @classmethod
    def from_config(cls, config: dict, where: Path) -> XLoraSettings:
        names = cls.__dataclass_fields__
        try:
            settings = cls(**{k: v for k, v in config.items() if k in names and v is not None or k == "top_k_lora"})
        except TypeError as e:
            raise AdapterError(f"{where}: {e}") from None
        for f in dataclasses.fields(cls):  # each value of its declared type (a finite number where numeric)
            value, kind = getattr(settings, f.name), f.type.split(" | ")[0]
            ok = isinstance(value, bool) if kind == "bool" else not isinstance(value, bool) and isinstance(
                value, int if kind == "int" else (int, float)) and math.isfinite(value)
            if not ok and not (value is None and "None" in f.type):
                raise AdapterError(f"{where}: {f.name} must be {'a finite number' if kind == 'float' else kind}, "
                                   f"got {value!r}")
        if settings.softmax_temperature <= 0:
            raise AdapterError(f"{where}: softmax_temperature must be positive, got {settings.softmax_temperature}")
        if settings.scaling_pass_value != 0:
            raise AdapterError(f"{where}: scaling_pass_value {settings.scaling_pass_value} is not supported (only 0: "
                               "the scaling pass is the base model, whose KV cache it shares)")
        if settings.xlora_depth < 1:
            raise AdapterError(f"{where}: xlora_depth must be at least 1, got {settings.xlora_depth}")
        if settings.top_k_lora is not None and settings.top_k_lora < 1:
            raise AdapterError(f"{where}: top_k_lora must be at least 1, got {settings.top_k_lora}")
        return settings

    def linear_indices(self) -> list[int]:
        """Positions of the classifier's linears in peft's nn.Sequential (ReLU, and Dropout when
        xlora_dropout_p > 0, after each but the last): their state-dict keys."""
        step = 3 if self.xlora_dropout_p > 0 else 2
        return [i * step for i in range(self.xlora_depth)]


@dataclass(frozen=True)
class XLoraClassifier:
    settings: XLoraSettings
    linears: list[tuple[torch.Tensor, torch.Tensor]]  # (weight [out, in], bias [out]) float32
    num_adapters: int
    num_modules: int

    def scalings(self, hidden: torch.Tensor) -> torch.Tensor:
        """Each row's scalings [T, modules, adapters] from its scaling-pass hidden state [T, H]
        (float32; every op is per row, so a row's scalings never depend on the batch)."""
        s = self.settings
        h = hidden.float().contiguous()
        for i, (w, b) in enumerate(self.linears):
            h = dense_linear(h, w, b)
            if i + 1 < len(self.linears):
                h = F.relu(h)
        if s.layerwise_scalings:
            logits = h.view(-1, self.num_modules, self.num_adapters)
        else:
            logits = h.unsqueeze(1).expand(-1, self.num_modules, -1)
        scalings = torch.softmax(logits / s.softmax_temperature, dim=-1) if s.enable_softmax else logits
        if s.top_k_lora is not None:
            top = torch.topk(scalings, k=min(s.top_k_lora, self.num_adapters), dim=-1).indices
            keep = torch.zeros_like(scalings, dtype=torch.bool).scatter_(-1, top, True)
            scalings = scalings * keep
        if s.enable_softmax_topk:
            kept = scalings != 0
            scalings = torch.softmax(scalings.masked_fill(~kept, float("-inf")), dim=-1).masked_fill(~kept, 0.0)
        return scalings.contiguous()


@dataclass(frozen=True)
class XLoraAdapter:
    name: str
    path: Path
    adapters: list[LoraAdapter]  # the experts, in the classifier's order
    classifier: XLoraClassifier
    modules: list[tuple[int, str]] = field(repr=False)  # (layer, target) of each adapted module, peft's order
    gather: torch.Tensor = field(repr=False)  # gather_index(modules): where each fused sub-projection's scalings are
    base_model: str | None = None

    scaling_pass = True  # the engine runs its scaling pass with a KV stream of its own

    @property
    def num_slots(self) -> int:
        return len(self.adapters)


def gather_index(modules: list[tuple[int, str]], num_layers: int) -> torch.Tensor:
    """[layers, fused projections (slots.FUSED's order), 3]: the module index of each sub-projection
    (q, k, v of a fused qkv...), or len(modules) where none is adapted (a zero column the user appends)."""
    out = torch.full((num_layers, len(FUSED), 3), len(modules), dtype=torch.long)
    for i, (layer, target) in enumerate(modules):
        f = next(j for j, subs in enumerate(FUSED.values()) if target in subs)
        out[layer, f, list(FUSED.values())[f].index(target)] = i
    return out


def is_xlora_folder(folder: str | Path, checked: CheckedFiles | None = None) -> bool:
    try:
        path = checked_folder(folder) / "adapter_config.json"
        return path.is_file() and read_adapter_config(path.parent, checked).get("peft_type") == "XLORA"
    except AdapterError:
        return False


def xlora_expert_paths(folder: Path) -> list[Path]:
    """The adapters' folders an X-LoRA checkpoint names; [] for anything else, or a checkpoint
    that cannot be read (loading it says why)."""
    try:
        config = read_adapter_config(folder)
        return expert_paths(folder, config, must_exist=False) if config.get("peft_type") == "XLORA" else []
    except AdapterError:
        return []


def _classifier_tensors(folder: Path, subfolders: list[str], checked: CheckedFiles | None) -> dict[str, torch.Tensor]:
    """Every classifier tensor the checkpoint holds, keyed as in the top-level file ("3.weight").
    A key of subfolder n lost ".{n}" to peft's save: "layers.weight" in subfolder "0" is "0.weight"."""
    found: dict[str, torch.Tensor] = {}
    for sub in [None, *(s for s in subfolders if (folder / s / "adapter_model.safetensors").is_file())]:
        tensors = read_adapter_tensors(folder if sub is None else folder / sub, checked)
        for key, t in tensors.items():
            if not key.startswith(_CLASSIFIER[:-1]):
                continue
            rest = key[len(_CLASSIFIER):] if key.startswith(_CLASSIFIER) else None
            if rest is None or rest in ("weight", "bias"):  # the mangled first linear of subfolder `sub`
                if sub is None or not sub.isdigit():
                    continue
                rest = f"{sub}.{key.rsplit('.', 1)[1]}"
            found.setdefault(rest, t)
    return found


def expert_paths(folder: Path, config: dict, must_exist: bool = True) -> list[Path]:
    """The adapters an X-LoRA checkpoint mixes, in order: its config's `adapters` values, as peft's
    loader reads them, a relative one taken from the checkpoint's folder."""
    adapters = config.get("adapters")
    if not isinstance(adapters, dict) or not adapters:
        raise AdapterError(f"{folder / 'adapter_config.json'}: no adapters")
    paths = []
    for key, value in adapters.items():
        path = Path(str(value)).expanduser()
        path = path if path.is_absolute() else folder / path
        if must_exist and not path.is_dir():
            raise AdapterError(f"{folder}: adapter {key!r} is at {value}, and no folder is there")
        paths.append(path)
    return paths


def load_xlora(folder: str | Path, cfg: ModelConfig, max_rank: int, name: str | None = None,
               checked: CheckedFiles | None = None) -> XLoraAdapter:
    """Read and check a peft X-LoRA checkpoint for a model of shape `cfg` (AdapterError names what is wrong;
    `checked`: as load_peft_adapter's, for every file of the checkpoint and of the adapters it mixes)."""
    folder = checked_folder(folder)
    config = read_adapter_config(folder, checked)
    where = folder / "adapter_config.json"
    if config.get("peft_type") != "XLORA":
        raise AdapterError(f"{where}: peft_type {config.get('peft_type')!r} is not an X-LoRA checkpoint")
    settings = XLoraSettings.from_config(config, where)
    if settings.hidden_size != cfg.hidden_size:
        raise AdapterError(f"{where}: hidden_size {settings.hidden_size}, and this model's is {cfg.hidden_size} "
                           "(an X-LoRA model for another base model)")
    if config.get("use_trainable_adapters"):
        raise AdapterError(f"{where}: use_trainable_adapters is not supported (the experts are read from the "
                           "subfolders as saved)")
    experts = []
    for i, path in enumerate(expert_paths(folder, config)):
        experts.append(load_peft_adapter(path, cfg, max_rank, f"{name or folder}[{i}]", checked))
    modules = sorted({m for a in experts for m in a.weights}, key=lambda m: (m[0], TARGETS.index(m[1])))
    classifier = _read_classifier(folder, [str(i) for i in range(len(experts))], settings, len(experts), len(modules),
                                  checked)
    return XLoraAdapter(name=name or str(folder), path=folder, adapters=experts, classifier=classifier,
                        modules=modules, gather=gather_index(modules, cfg.num_layers), base_model=config.get("base_model_name_or_path"))


def _read_classifier(folder: Path, subfolders: list[str], s: XLoraSettings, n_adapters: int,
                     n_modules: int, checked: CheckedFiles | None = None) -> XLoraClassifier:
    tensors = _classifier_tensors(folder, subfolders, checked)
    out = n_adapters * n_modules if s.layerwise_scalings else n_adapters
    widths = [s.hidden_size] + [s.xlora_size] * (s.xlora_depth - 1) + [out]
    linears = []
    for j, idx in enumerate(s.linear_indices()):
        w, b = tensors.get(f"{idx}.weight"), tensors.get(f"{idx}.bias")
        if w is None or b is None:
            raise AdapterError(f"{folder}: the X-LoRA classifier's linear {idx} is missing from the checkpoint")
        want = (widths[j + 1], widths[j])
        if tuple(w.shape) != want or tuple(b.shape) != want[:1]:
            raise AdapterError(f"{folder}: the X-LoRA classifier's linear {idx} is {tuple(w.shape)}, expected {want} "
                               f"({n_adapters} adapters over {n_modules} adapted modules)")
        if not (torch.isfinite(w).all() and torch.isfinite(b).all()):
            raise AdapterError(f"{folder}: the X-LoRA classifier has non-finite weights")
        linears.append((w.float().contiguous(), b.float().contiguous()))
    return XLoraClassifier(s, linears, n_adapters, n_modules)
