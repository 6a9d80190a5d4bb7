"""A float model (AWQ scales folded in, or not) written as a Hugging Face AWQ checkpoint: GEMM
version, 4-bit, zero points, the layout AutoAWQ writes and quant/checkpoints.py reads. Or (SmoothQuant
scales folded in) written as a plain 16/32-bit Hugging Face folder: write_float_folder.

- Every q/k/v/o/gate/up/down projection: `qweight` [K, N/8], `qzeros` [K/g, N/8] (int32, packed by
  checkpoints.awq_parts) and `scales` [K/g, N] (fp16), quantized by rtn.quantize_int4_checkpoint:
  round-to-nearest with integer zero points, the only form the format holds.
- Everything else (embeddings, norms, the LM head, biases) dense in fp16, the dtype AWQ checkpoints
  and their kernels use.
- config.json with `quantization_config` {"quant_method": "awq", "bits": 4, "group_size": g,
  "zero_point": true, "version": "gemm"}, the tokenizer files and generation_config.json.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ruvllm.config import ModelConfig, QuantConfig
from ruvllm.loader import ModelSource, iter_weights, load_model_config, load_tokenizer
from ruvllm.loader import hf_folder
from ruvllm.loader.hf_writer import folder_in_place, hf_config, save_tokenizer, write_safetensors
from ruvllm.quant.checkpoints import awq_parts
from ruvllm.quant.plan import keeps_16bit
from ruvllm.quant.rtn import FP16_MAX, quantize_int4_checkpoint
from ruvllm.quant.weights import INT4_GROUP_SIZES

GENERATION_CONFIG = "generation_config.json"


def quantization_config(group_size: int) -> dict[str, Any]:
    return {"quant_method": "awq", "bits": 4, "group_size": group_size, "zero_point": True, "version": "gemm"}


def check_awq_shapes(cfg: ModelConfig, group_size: int) -> None:
    """ValueError, naming the layers, when the model's linear layers cannot be written with groups of
    `group_size` inputs (the size must divide every input size) or packed eight outputs to an int32."""
    if group_size not in INT4_GROUP_SIZES:
        raise ValueError(f"--group-size must be one of {', '.join(map(str, INT4_GROUP_SIZES))} "
                         f"(the group sizes ruvllm's int4 kernels take), got {group_size}")
    inputs = {"q_proj, k_proj, v_proj, gate_proj and up_proj": cfg.hidden_size, "o_proj": cfg.q_size,
              "down_proj": cfg.intermediate_size}
    for layers, k in inputs.items():
        if k % group_size:
            fits = [g for g in INT4_GROUP_SIZES if all(size % g == 0 for size in inputs.values())]
            hint = f"group sizes that fit this model: {', '.join(map(str, fits))}" if fits else \
                "no supported group size fits this model"
            raise ValueError(f"group size {group_size} does not divide the input size {k} of {layers}; {hint}")
    outputs = {"q_proj and o_proj's input": cfg.q_size, "k_proj and v_proj": cfg.kv_size,
               "o_proj and down_proj": cfg.hidden_size, "gate_proj and up_proj": cfg.intermediate_size}
    for layers, n in outputs.items():
        if n % 8:
            raise ValueError(f"AWQ packs eight outputs to an int32; the output size {n} of {layers} is not a multiple of 8")


def load_float_model(src: ModelSource, max_positions: int) -> tuple[nn.Module, ModelConfig, list[str]]:
    """ruvllm's model of `src` with every weight dense in float32 (GGUF and GPTQ/AWQ layers
    dequantized), its config, and the Hugging Face names of the tensors it was loaded from."""
    from ruvllm.models.registry import build_model

    cfg = load_model_config(src)
    names: list[str] = []

    def recorded(stream: Iterator[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
        for name, tensor in stream:
            names.append(name)
            yield name, tensor

    model = build_model(cfg, recorded(iter_weights(src, torch.float32)), str(src.path), max(2, max_positions),
                        torch.float32, quant=QuantConfig("none"))
    return model, cfg, names


# The dtypes a float folder may be written in.
FLOAT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _fp16(name: str, t: torch.Tensor, what: str = "an AWQ checkpoint") -> torch.Tensor:
    if t.abs().max() > FP16_MAX:
        raise ValueError(f"{name}: values beyond fp16 range cannot be written to {what}")
    return t.to(torch.float16).contiguous()


def _named_values(model: nn.Module, names: list[str]) -> Iterator[tuple[str, str, str, torch.Tensor]]:
    """(source name, our module name, attribute, value) of each tensor the model was loaded from,
    q/k/v and gate/up cut back out of our fused weights."""
    for name in names:
        pname, offset, rows = model.target(name.removeprefix("model."))
        value = model.get_parameter(pname).data
        if offset is not None:
            value = value[offset:offset + rows]
        elif pname.endswith("norm.weight"):  # held as norm_offset + w (Gemma 3's 1 + w); the files hold w
            value = value - model.norm_offset
        module_name, attr = pname.rsplit(".", 1)
        yield name, module_name, attr, value


def awq_tensors(model: nn.Module, names: list[str], group_size: int) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors, under the source's names: each linear weight (q/k/v and gate/up cut
    back out of our fused ones) as qweight/qzeros/scales, the rest fp16."""
    keep = QuantConfig("int4")  # its default keep_16bit: the embeddings and the LM head
    for name, module_name, attr, value in _named_values(model, names):
        if attr == "weight" and isinstance(model.get_submodule(module_name), nn.Linear) \
                and not keeps_16bit(keep, module_name):
            prefix = name.removesuffix(".weight")
            for part, tensor in awq_parts(quantize_int4_checkpoint(value, group_size, prefix)).items():
                yield f"{prefix}.{part}", tensor
        else:
            yield name, _fp16(name, value)


def float_tensors(model: nn.Module, names: list[str], dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor dense in `dtype`, under the source's names."""
    for name, _, _, value in _named_values(model, names):
        if dtype == torch.float16:
            yield name, _fp16(name, value, "a float16 folder; write bfloat16 or float32")
        else:
            yield name, value.to(dtype).contiguous()


def _config_json(src: ModelSource, cfg: ModelConfig, dtype: torch.dtype, folder: Path,
                 quantization: dict[str, Any] | None) -> dict[str, Any]:
    """The source's config.json (or one built from a GGUF's metadata) declaring `dtype` and
    `quantization` as the quantization_config (none: a dense folder, the source's own dropped)."""
    name = str(dtype).removeprefix("torch.")
    if src.format == "hf":
        data = dict(hf_folder.read_config_json(src.path))
        keys = [k for k in ("dtype", "torch_dtype") if k in data] or ["dtype"]
        for key in keys:
            data[key] = name
    else:
        hf_config(cfg, dtype).save_pretrained(str(folder))
        data = json.loads((folder / hf_folder.CONFIG_FILE).read_text(encoding="utf-8"))
    data.pop("quantization_config", None)
    if quantization is not None:
        data["quantization_config"] = quantization
    return data


def _write_generation_config(src: ModelSource, cfg: ModelConfig, folder: Path) -> None:
    source = src.path / GENERATION_CONFIG if src.format == "hf" else None
    if source is not None and source.is_file():
        shutil.copyfile(source, folder / GENERATION_CONFIG)
        return
    from transformers import GenerationConfig

    eos = list(cfg.eos_token_ids)
    GenerationConfig(bos_token_id=cfg.bos_token_id,
                     eos_token_id=eos[0] if len(eos) == 1 else (eos or None)).save_pretrained(str(folder))


def _write_folder(src: ModelSource, model: nn.Module, out: Path, dtype: torch.dtype,
                  quantization: dict[str, Any] | None, tensors: Iterator[tuple[str, torch.Tensor]],
                  replace: bool, tokenizer: Any) -> None:
    """config.json, generation_config.json, the tokenizer and `tensors`, built beside `out` and
    renamed into place (see hf_writer.folder_in_place)."""
    cfg = model.cfg
    if tokenizer is None:
        tokenizer = load_tokenizer(src)
    with folder_in_place(out, replace=replace) as tmp:
        config = _config_json(src, cfg, dtype, tmp, quantization)
        (tmp / hf_folder.CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
        _write_generation_config(src, cfg, tmp)
        save_tokenizer(tokenizer, cfg, tmp)
        write_safetensors(tensors, tmp)


def write_awq_folder(src: ModelSource, model: nn.Module, names: list[str], out: Path, group_size: int,
                     replace: bool = False, tokenizer: Any = None) -> None:
    """Write `model` (loaded by load_float_model(src), scales folded or not) as an AWQ checkpoint
    folder at `out`."""
    check_awq_shapes(model.cfg, group_size)
    _write_folder(src, model, out, torch.float16, quantization_config(group_size),
                  awq_tensors(model, names, group_size), replace, tokenizer)


def write_float_folder(src: ModelSource, model: nn.Module, names: list[str], out: Path,
                       dtype: torch.dtype = torch.float32, replace: bool = False, tokenizer: Any = None) -> None:
    """Write `model` (loaded by load_float_model(src), e.g. with SmoothQuant scales folded in) as a
    dense Hugging Face folder in `dtype`, under the source's tensor names, at `out`."""
    if dtype not in FLOAT_DTYPES.values():
        raise ValueError(f"a float folder is written in {', '.join(FLOAT_DTYPES)}, not {dtype}")
    _write_folder(src, model, out, dtype, None, float_tensors(model, names, dtype), replace, tokenizer)
