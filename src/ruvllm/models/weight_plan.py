"""What loading a model will hold, weight by weight, decided before any tensor data is read.

`weight_plan(source, quantization)` reads only the files' headers: which tensors there are, their
shapes, and which of them a loader can hand over in the file's own packed codes. It maps them onto
the model's parameters (fusing q/k/v and gate/up as the model does) and gives each linear weight
the form quant.plan chooses. The loader fills the model by this plan (LlamaForCausalLM.load_weights),
and `ruvllm info -q` reports it, so the two cannot disagree.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from ruvllm.config import ModelConfig, QuantConfig
from ruvllm.dtypes import resolve_model_dtype
from ruvllm.errors import CorruptModelError
from ruvllm.quant.plan import fused_stored_form, keeps_16bit, planned_form, quantization_for_device, quantizes_weights
from ruvllm.quant.weights import estimate_bytes

if TYPE_CHECKING:
    from ruvllm.loader import ModelSource

__all__ = ["FileTensor", "PlannedWeight", "WeightPlan", "file_tensors", "float_weight_plan", "plan_weights",
           "weight_plan"]

# Quantizations under which a tied LM head gets its own packed copy of the embeddings.
_PACKED_HEAD_METHODS = ("auto", "int8", "int4", "w8a8")


@dataclass(frozen=True)
class FileTensor:
    name: str  # Hugging Face name
    shape: tuple[int, ...]  # torch order: (out_features, in_features) for a matrix
    packed: tuple[str, int] | None  # (kind, group) of the file's own codes a loader can hand over; None: float


@dataclass(frozen=True)
class PlannedWeight:
    param: str  # our parameter ("layers.0.qkv_proj.weight"); "lm_head.weight" also for a tied head's packed copy
    shape: tuple[int, ...]
    stored: tuple[str, int] | None  # the (fused) form the loader hands over; None: float
    form: tuple[str, int]  # what it is kept as: ("dense", 0), ("int8", 0 or 32), ("int4", group)
    linear: bool
    nbytes: int


@dataclass(frozen=True)
class WeightPlan:
    source: str
    quant: QuantConfig  # as the device takes it (quantization_for_device)
    dtype: torch.dtype  # the compute dtype; dense weights are held in it
    keep_packed: bool  # whether the loader hands over files' packed codes (else dequantized floats)
    weights: dict[str, PlannedWeight]  # by parameter, in the order the loader completes them

    @property
    def total_bytes(self) -> int:
        return sum(w.nbytes for w in self.weights.values())

    def linear_forms(self) -> Counter[str]:
        """Count of linear weights by form, e.g. {"int4 g32": 119, "int8": 1}."""
        dense = f"dense {str(self.dtype).removeprefix('torch.')}"
        return Counter(dense if w.form[0] == "dense" else f"{w.form[0]} g{w.form[1]}" if w.form[1] else w.form[0]
                       for w in self.weights.values() if w.linear)


def weight_plan(source: str | Path | ModelSource | None, quantization: QuantConfig | None = None,
                dtype: str | torch.dtype = "auto", device: str | torch.device = "cpu") -> WeightPlan:
    """The plan for loading `source` (a path, None for the embedded default, or a resolved
    ModelSource) with `quantization` at `dtype` on `device`; from headers only."""
    from ruvllm.loader import ModelSource, load_model_config, resolve_model

    src = source if isinstance(source, ModelSource) else resolve_model(source)
    quant, resolved = _settings(quantization, dtype, device)
    return plan_weights(load_model_config(src), file_tensors(src), quant, resolved, str(src.path),
                        _our_cpu_kernels(torch.device(device)))


def float_weight_plan(cfg: ModelConfig, quantization: QuantConfig | None = None, dtype: str | torch.dtype = "auto",
                      device: str | torch.device = "cpu", source: str = "in-memory") -> WeightPlan:
    """The plan for float weights that come from code (random models for tests and benchmarks):
    every parameter of the model, none packed. (Fused parameters are listed whole: a float piece's
    stored form is None either way, and the model's own names map to themselves.)"""
    quant, resolved = _settings(quantization, dtype, device)
    tensors = [FileTensor(name, tuple(p.shape), None) for name, p in _meta_model(cfg, resolved).named_parameters()]
    return plan_weights(cfg, tensors, quant, resolved, source, _our_cpu_kernels(torch.device(device)))


def _settings(quantization: QuantConfig | None, dtype: str | torch.dtype,
              device: str | torch.device) -> tuple[QuantConfig, torch.dtype]:
    """The quantization as the device takes it, and the compute dtype ("auto" and names resolved)."""
    device = torch.device(device)
    quant = quantization_for_device(quantization or QuantConfig(), device)
    resolved = dtype if isinstance(dtype, torch.dtype) else resolve_model_dtype(dtype, quant, device.type)
    return quantization_for_device(quant, device, resolved, _our_cpu_kernels(device)), resolved


def _our_cpu_kernels(device: torch.device) -> bool:
    """Whether packed weights will run on our CPU kernels (they build on first use; set-up builds them)."""
    if device.type != "cpu":
        return False
    from ruvllm.cpu_build import kernels

    return kernels() is not None


def plan_weights(cfg: ModelConfig, tensors: list[FileTensor], quant: QuantConfig, dtype: torch.dtype,
                 source: str, cpu: bool = True) -> WeightPlan:
    """The plan from a tensor list: every parameter once, fused pieces together, each linear in
    quant.plan's form, the rest dense in `dtype`. `cpu`: packed weights run on our CPU kernels
    (their layout, so their bytes, differs from PyTorch's kernels': quant.weights.estimate_bytes)."""
    model = _meta_model(cfg, dtype)
    expected = {n: tuple(p.shape) for n, p in model.named_parameters()}
    keep_packed = quantizes_weights(quant)
    pieces: dict[str, list[FileTensor]] = {}  # in the order the loader completes them (file order)
    for t in tensors:
        name = t.name.removeprefix("model.")
        if (name == "lm_head.weight" and cfg.tie_word_embeddings) or "rotary_emb" in name:
            continue
        pname, _, _ = model.target(name)
        if pname not in expected:
            raise CorruptModelError(f"{source}: unexpected tensor {name!r}")
        pieces[pname] = pieces.pop(pname, []) + [t]
    missing = [n for n in expected if n not in pieces]
    if missing:
        raise CorruptModelError(f"{source}: missing or incomplete tensors: {', '.join(missing[:5])}")

    elem = torch.empty((), dtype=dtype).element_size()
    weights: dict[str, PlannedWeight] = {}

    def add(pname: str, stored: tuple[str, int] | None, linear: bool) -> None:
        shape = expected.get(pname) or expected["embed_tokens.weight"]
        form = planned_form(quant, pname.rsplit(".", 1)[0], stored, shape, dtype) if linear else ("dense", 0)
        nbytes = math.prod(shape) * elem if form[0] == "dense" else estimate_bytes(form[0], *shape, form[1], cpu)
        weights[pname] = PlannedWeight(pname, shape, stored, form, linear, nbytes)

    for pname, parts in pieces.items():
        module_name, attr = pname.rsplit(".", 1)
        linear = attr == "weight" and isinstance(model.get_submodule(module_name), nn.Linear)
        add(pname, fused_stored_form([t.packed if keep_packed else None for t in parts]), linear)
    # A tied head's packed copy of the embeddings, made from them at load; under auto, in the form
    # the file stores the table in (none for a float table).
    table = weights["embed_tokens.weight"].stored
    if (cfg.tie_word_embeddings and not keeps_16bit(quant, "lm_head") and quant.method in _PACKED_HEAD_METHODS
            and (quant.method != "auto" or table is not None)):
        add("lm_head.weight", table if quant.method == "auto" else None, True)
    return WeightPlan(source, quant, dtype, keep_packed, weights)


def _meta_model(cfg: ModelConfig, dtype: torch.dtype) -> nn.Module:
    from ruvllm.layers.rotary import RotaryEmbedding
    from ruvllm.models.registry import model_class

    rope = RotaryEmbedding(cfg.head_dim, 1, cfg.rope_theta, cfg.rope_scaling, dtype)  # one position: tiny
    with torch.device("meta"):  # shapes only: no weight memory is allocated
        return model_class(cfg, "model")(cfg, rope)


def file_tensors(src: ModelSource) -> list[FileTensor]:
    """The weights the loader yields, from headers only: GGUF tensor list, safetensors headers.
    For a model that passed load_model_config's checks (the files' structure is not re-checked)."""
    if src.format == "gguf":
        return _gguf_tensors(src.path)
    return _safetensors_tensors(src.path)


def _gguf_tensors(path: Path) -> list[FileTensor]:
    from ruvllm.loader import gguf_file, gguf_weights
    from ruvllm.loader.gguf_header import read_header
    from ruvllm.quant.gguf_blocks import INT4_GGUF_TYPES, KEPT_GGUF_TYPES

    out = []
    header = read_header(path)
    arch = header.get("general.architecture")
    for t in header.tensors:
        name = gguf_file.hf_name(t.name, arch if isinstance(arch, str) else None)
        if name is None:  # rope_freqs.weight: folded into the config
            continue
        packed = None
        if t.tensor_type in KEPT_GGUF_TYPES and len(t.shape) == 2:  # as gguf_weights.iter_weights keeps them
            packed = ("int4" if t.tensor_type in INT4_GGUF_TYPES else "int8", 32)  # gguf_blocks: groups of 32
        elif gguf_weights.requantized(t):
            packed = ("int8", 32)
        out.append(FileTensor(name, t.shape, packed))
    return out


def _safetensors_tensors(folder: Path) -> list[FileTensor]:
    from ruvllm.loader import hf_folder
    from ruvllm.loader.safetensors_header import read_safetensors_header
    from ruvllm.quant.checkpoint_scheme import checkpoint_quant

    config = hf_folder.load_config(folder)
    scheme = checkpoint_quant(hf_folder.read_config_json(folder), str(folder))
    where = {name: (file, entry.shape) for file in hf_folder.weight_files(folder)
             for name, entry in read_safetensors_header(file).items()}
    out = []
    for name, (_file, shape) in where.items():
        # the same skips as hf_weights.iter_weights
        if (config.tie_word_embeddings and name == "lm_head.weight") or name.endswith("rotary_emb.inv_freq"):
            continue
        prefix, _, leaf = name.rpartition(".")
        if scheme is None:
            out.append(FileTensor(name, shape, None))
        elif leaf == "qweight":
            out.append(FileTensor(f"{prefix}.weight", *_checkpoint_layer(where, prefix, scheme.method)))
        elif leaf not in scheme.parts and not (leaf == "bias" and not (
                config.attention_bias and prefix.endswith(("q_proj", "k_proj", "v_proj")))):
            out.append(FileTensor(name, shape, None))  # (GPTQ's zero biases are dropped by the loader)
    return out


def _checkpoint_layer(where: dict[str, tuple[Path, tuple[int, ...]]], prefix: str,
                      method: str) -> tuple[tuple[int, int], tuple[str, int]]:
    """Shape and packed form of one GPTQ/AWQ layer, as quant.checkpoints.assemble makes it: int4 in
    the checkpoint's groups where our kernel takes them, else per-channel int8."""
    from ruvllm.quant.weights import INT4_GROUP_SIZES, INT4_ROWS_MULTIPLE

    # qweight packs 8 codes per int32: [K/8, N] (GPTQ) or [K, N/8] (AWQ); scales are [groups, N].
    q = where[f"{prefix}.qweight"][1]
    n, k = (q[1], q[0] * 8) if method == "gptq" else (q[1] * 8, q[0])
    group = k // max(1, where[f"{prefix}.scales"][1][0]) if f"{prefix}.scales" in where else k
    fits = group in INT4_GROUP_SIZES and n % INT4_ROWS_MULTIPLE == 0 and _groups_in_order(where, prefix, k, group)
    return (n, k), ("int4", group) if fits else ("int8", 0)


def _groups_in_order(where: dict[str, tuple[Path, tuple[int, ...]]], prefix: str, k: int, group: int) -> bool:
    """Whether a GPTQ layer's g_idx (absent in AWQ) puts inputs in consecutive groups; act-order
    checkpoints do not. The only tensor data a plan reads: K small integers per layer."""
    from safetensors import safe_open

    if f"{prefix}.g_idx" not in where:
        return True
    with safe_open(str(where[f"{prefix}.g_idx"][0]), framework="pt") as f:
        g_idx = f.get_tensor(f"{prefix}.g_idx").long()
    return torch.equal(g_idx, torch.arange(k) // group) if g_idx.numel() == k else False
