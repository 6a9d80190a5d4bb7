"""A Hugging Face folder's safetensors tensors, one at a time, GPTQ/AWQ layers assembled into our int4
form (hf_folder.py reads the config and the index, without torch)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from ruvllm.config import ModelConfig
from ruvllm.errors import CorruptModelError
from ruvllm.loader.hf_folder import CONFIG_FILE, INDEX_FILE, load_config, read_config_json, shards
from ruvllm.loader.safetensors_header import read_safetensors_header
from ruvllm.quant.checkpoint_scheme import checkpoint_quant
from ruvllm.quant.checkpoints import assemble
from ruvllm.quant.weights import QuantizedWeight


def iter_weights(folder: Path, dtype: torch.dtype,
                 keep_quantized: bool = False) -> Iterator[tuple[str, torch.Tensor | QuantizedWeight]]:
    """(Hugging Face name, tensor) one at a time, so peak memory stays near one tensor.

    config.json, the shard list and each shard's header (truncation) are checked eagerly; tensor
    data is read lazily. GPTQ/AWQ checkpoints yield each quantized layer as `<layer>.weight`: a
    QuantizedWeight with keep_quantized, else its exact float values in dtype.
    """
    config = load_config(folder)
    scheme = checkpoint_quant(read_config_json(folder), str(folder / CONFIG_FILE))
    files = shards(folder)
    for file in files:
        if not file.is_file():
            raise CorruptModelError(f"{file}: listed in {INDEX_FILE} but missing")
        read_safetensors_header(file)  # bounded and checked: a cut file fails here, naming the tensor
    raw_dtype = None if scheme is not None else dtype  # quantized parts keep their integer types
    stream = _generate(files, config.tie_word_embeddings, raw_dtype)
    if scheme is None:
        return stream
    return _cast_dense(_drop_zero_biases(assemble(stream, scheme, str(folder), keep_quantized), config), dtype)


def _drop_zero_biases(stream: Iterator[tuple[str, Any]], config: ModelConfig) -> Iterator[tuple[str, Any]]:
    """GPTQ exporters write an all-zero bias for every layer; ours has biases only on q/k/v of
    models with attention_bias. A zero bias is a no-op, so those are dropped, not refused."""
    for name, tensor in stream:
        if name.endswith(".bias") and isinstance(tensor, torch.Tensor) and not tensor.any():
            qkv = name.endswith(("q_proj.bias", "k_proj.bias", "v_proj.bias"))
            if not (qkv and config.attention_bias):
                continue
        yield name, tensor


def _cast_dense(stream: Iterator[tuple[str, Any]], dtype: torch.dtype) -> Iterator[tuple[str, Any]]:
    for name, tensor in stream:
        yield name, tensor if isinstance(tensor, QuantizedWeight) else tensor.to(dtype)


def _generate(
    files: dict[Path, list[str] | None], tied: bool, dtype: torch.dtype | None
) -> Iterator[tuple[str, torch.Tensor]]:
    for file, names in files.items():
        try:
            with safe_open(str(file), framework="pt") as f:
                for name in names if names is not None else list(f.keys()):
                    # Tied checkpoints sometimes still store lm_head; callers use embed_tokens for it.
                    if (tied and name == "lm_head.weight") or name.endswith("rotary_emb.inv_freq"):
                        continue
                    tensor = f.get_tensor(name)
                    yield name, tensor if dtype is None else tensor.to(dtype)
        except SafetensorError as e:
            raise CorruptModelError(f"{file}: unreadable safetensors file ({e})") from None
