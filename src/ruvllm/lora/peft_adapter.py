"""A PEFT LoRA adapter folder (`adapter_config.json` + `adapter_model.safetensors`) read and checked
against the model it is to run on.

Each targeted projection becomes (A [r, K], B [N, r]) in float32, with PEFT's scaling (alpha / r,
or alpha / sqrt(r) with rsLoRA, per module under `alpha_pattern`) folded into B. What this engine
does not run (DoRA, `modules_to_save`, LoRA on embeddings or the LM head, bias training, other PEFT
methods) is refused with a message naming it, as is an adapter made for another model shape.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ruvllm.config import ModelConfig
from ruvllm.errors import AdapterError
from ruvllm.lora.checked_files import CheckedFiles, read_file

# Hugging Face module names of the projections an adapter may target, by their decoder sublayer.
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
SUBLAYER = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
             "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}
_KEY = re.compile(r"^(?:base_model\.model\.)?model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")


def projection_shape(cfg: ModelConfig, target: str) -> tuple[int, int]:
    """(input features K, output features N) of a target projection in this model."""
    return {"q_proj": (cfg.hidden_size, cfg.q_size), "k_proj": (cfg.hidden_size, cfg.kv_size),
            "v_proj": (cfg.hidden_size, cfg.kv_size), "o_proj": (cfg.q_size, cfg.hidden_size),
            "gate_proj": (cfg.hidden_size, cfg.intermediate_size), "up_proj": (cfg.hidden_size, cfg.intermediate_size),
            "down_proj": (cfg.intermediate_size, cfg.hidden_size)}[target]


@dataclass(frozen=True)
class LoraAdapter:
    name: str
    path: Path
    rank: int  # the largest rank of any of its modules
    # (layer, target) -> (A [r, K], B [N, r] with the scaling folded in), float32 on the CPU
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = field(repr=False)
    base_model: str | None = None

    scaling_pass = False  # only X-LoRA models run a scaling pass (lora/xlora.py)
    num_slots = 1  # adapter slots it takes when a step uses it

    @property
    def nbytes(self) -> int:
        return sum(a.numel() * a.element_size() + b.numel() * b.element_size() for a, b in self.weights.values())


def _pattern_value(patterns: dict, module: str, default: float) -> float:
    """PEFT's rank/alpha patterns: a key applies to a module whose name ends with it (as a regex)."""
    for key, value in patterns.items():
        if re.match(rf"(.*\.)?{key}$", module):
            return value
    return default


def checked_folder(path: str | Path) -> Path:
    """An adapter folder that exists, or AdapterError naming why not (a NUL byte or a name over the
    file system's limit included: those make the OS calls raise, not answer no)."""
    folder = Path(path).expanduser()
    try:
        if folder.is_dir():
            return folder
    except (OSError, ValueError) as e:
        raise AdapterError(f"adapter path {str(path)[:200]!r} is not usable ({e})") from None
    raise AdapterError(f"adapter {folder}: no such folder")


def read_adapter_config(folder: Path, checked: CheckedFiles | None = None) -> dict:
    """`checked`: the files the server's path policy checked for this load (lora/checked_files.py)."""
    path = folder / "adapter_config.json"
    if not path.is_file():
        raise AdapterError(f"{folder}: no adapter_config.json (not a PEFT adapter folder)")
    try:
        config = json.loads(read_file(path, checked).decode("utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise AdapterError(f"{path}: not readable JSON ({e})") from None
    if not isinstance(config, dict):
        raise AdapterError(f"{path}: not a JSON object")
    return config


def check_lora_config(config: dict, where: Path) -> None:
    """Refuse, by name, what a PEFT LoRA config may ask for and this engine does not run."""
    kind = config.get("peft_type")
    if kind != "LORA":
        raise AdapterError(f"{where}: peft_type {kind!r} is not supported (only LORA adapters)")
    if config.get("use_dora"):
        raise AdapterError(f"{where}: DoRA adapters (use_dora) are not supported")
    if config.get("modules_to_save"):
        raise AdapterError(f"{where}: modules_to_save ({', '.join(map(str, config['modules_to_save']))}) is not "
                           "supported: only LoRA deltas on the attention and MLP projections are")
    if config.get("bias", "none") != "none" or config.get("lora_bias"):
        raise AdapterError(f"{where}: trained biases (bias={config.get('bias')!r}) are not supported")
    if config.get("fan_in_fan_out"):
        raise AdapterError(f"{where}: fan_in_fan_out (Conv1D-style weights) is not supported")
    if config.get("layer_replication"):
        raise AdapterError(f"{where}: layer_replication is not supported")
    targets = config.get("target_modules")
    if not (targets is None or isinstance(targets, str)
            or isinstance(targets, list) and all(isinstance(t, str) for t in targets)):
        raise AdapterError(f"{where}: target_modules must be a module name or a list of them, got {targets!r}")
    if isinstance(targets, list):
        unknown = [t for t in targets if t.split(".")[-1] not in TARGETS]
        if unknown:
            raise AdapterError(f"{where}: target modules {', '.join(map(str, unknown))} do not exist in this model "
                               f"(LoRA can target {', '.join(TARGETS)})")
    for key in ("r", "lora_alpha"):
        _check_number(config.get(key, 8), f"{where}: {key}")
    for key in ("alpha_pattern", "rank_pattern"):
        patterns = config.get(key) or {}
        if not isinstance(patterns, dict) or not all(isinstance(k, str) for k in patterns):
            raise AdapterError(f"{where}: {key} must map module names to numbers, got {patterns!r}")
        for module, value in patterns.items():
            _check_number(value, f"{where}: {key}[{module!r}]")


# A LoRA delta is B A x * scaling; trained adapters use scalings of about 0.1 to 100. Past this, 16-bit
# activations overflow (fp16's largest is 65504) and outputs turn to NaN instead of failing the load.
MAX_SCALING = 1e4


def _check_number(value: object, what: str) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
        raise AdapterError(f"{what} must be a positive finite number, got {value!r}")


def load_peft_adapter(folder: str | Path, cfg: ModelConfig, max_rank: int, name: str | None = None,
                      checked: CheckedFiles | None = None) -> LoraAdapter:
    """Read and check a PEFT LoRA adapter for a model of shape `cfg`. Raises AdapterError naming the
    problem: missing or corrupt files, an unsupported feature, a rank over `max_rank`, a target this
    model does not have, or shapes made for another model. With `checked`, only the files the
    server's path policy checked are read (AdapterPathError otherwise)."""
    folder = checked_folder(folder)
    config = read_adapter_config(folder, checked)
    check_lora_config(config, folder / "adapter_config.json")
    weights_path = folder / "adapter_model.safetensors"
    tensors = read_adapter_tensors(folder, checked)
    return adapter_from_tensors(tensors, config, cfg, max_rank, name or str(folder), folder, weights_path)


def read_adapter_tensors(folder: Path, checked: CheckedFiles | None = None) -> dict[str, torch.Tensor]:
    """The tensors of a PEFT folder's adapter_model.safetensors (AdapterError when missing or corrupt)."""
    from safetensors import SafetensorError
    from safetensors.torch import load

    weights_path = folder / "adapter_model.safetensors"
    if not weights_path.is_file():
        if (folder / "adapter_model.bin").is_file():
            raise AdapterError(f"{folder}: adapter_model.bin is a pickle, which is not loaded; "
                               "save the adapter with safetensors (PEFT's default)")
        raise AdapterError(f"{folder}: no adapter_model.safetensors")
    try:
        data = read_file(weights_path, checked)  # outside the try below: a path refusal is no format error
    except OSError as e:
        raise AdapterError(f"{weights_path}: not readable ({e})") from None
    try:
        return load(data)
    except (SafetensorError, ValueError, RuntimeError) as e:
        raise AdapterError(f"{weights_path}: not a readable safetensors file ({e})") from None


def adapter_from_tensors(tensors: dict[str, torch.Tensor], config: dict, cfg: ModelConfig, max_rank: int, name: str,
                         folder: Path, weights_path: Path) -> LoraAdapter:
    """Check LoRA pairs (PEFT tensor names, PEFT config) against a model of shape `cfg`."""
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        m = _KEY.match(key)
        if m is None:
            what = "embeddings" if "embed" in key else "the LM head" if "lm_head" in key else None
            raise AdapterError(f"{weights_path}: tensor {key} is not supported"
                               + (f" (LoRA on {what})" if what else " (only lora_A/lora_B of the decoder's projections)"))
        layer, sublayer, target, which = int(m[1]), m[2], m[3], m[4]
        if target not in TARGETS or SUBLAYER[target] != sublayer:
            raise AdapterError(f"{weights_path}: target module {sublayer}.{target} does not exist in this model")
        if layer >= cfg.num_layers:
            raise AdapterError(f"{weights_path}: {key} is for layer {layer}, and the model has {cfg.num_layers} "
                               "layers (an adapter for another base model)")
        pairs.setdefault((layer, target), {})[which] = tensor
    if not pairs:
        raise AdapterError(f"{weights_path}: no LoRA weights")

    # The ranks are the tensors' own (`r` and `rank_pattern` only say how they were made).
    alpha_default = config.get("lora_alpha", 8)
    rslora = bool(config.get("use_rslora"))
    alphas = config.get("alpha_pattern") or {}
    out: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
    for (layer, target), ab in sorted(pairs.items()):
        module = f"model.layers.{layer}.{SUBLAYER[target]}.{target}"
        if set(ab) != {"A", "B"}:
            raise AdapterError(f"{weights_path}: {module} has lora_{'A' if 'A' in ab else 'B'} without "
                               f"lora_{'B' if 'A' in ab else 'A'}")
        a, b = ab["A"], ab["B"]
        k, n = projection_shape(cfg, target)
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[1]:
            raise AdapterError(f"{weights_path}: {module}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} "
                               "do not make a LoRA pair")
        if a.shape[1] != k or b.shape[0] != n:
            raise AdapterError(f"{weights_path}: {module} maps {a.shape[1]} -> {b.shape[0]} features, and this "
                               f"model's {target} maps {k} -> {n} (an adapter for another base model)")
        rank = a.shape[0]
        if rank < 1:
            raise AdapterError(f"{weights_path}: {module} has rank 0 (empty lora_A/lora_B)")
        if rank > max_rank:
            raise AdapterError(f"{weights_path}: {module} has rank {rank}, over the maximum {max_rank} "
                               "(--max-lora-rank)")
        if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
            raise AdapterError(f"{weights_path}: {module} has non-finite weights")
        alpha = _pattern_value(alphas, module, alpha_default)
        scaling = alpha / math.sqrt(rank) if rslora else alpha / rank
        if scaling > MAX_SCALING:
            raise AdapterError(f"{weights_path}: {module}'s scaling (lora_alpha {alpha} / rank) is {scaling:g}, over "
                               f"{MAX_SCALING:g}: its activations would overflow")
        out[(layer, target)] = (a.float().contiguous(), (b.float() * scaling).contiguous())
    return LoraAdapter(name=name, path=folder, rank=max(a.shape[0] for a, _ in out.values()),
                       weights=out, base_model=config.get("base_model_name_or_path"))
