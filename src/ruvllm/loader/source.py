"""A model's files: resolve a path, read its config, stream its weights, build its tokenizer.

Two formats are understood: Hugging Face folders (config.json + safetensors) and GGUF files.
Both produce the same ModelConfig and the same Hugging Face tensor names, so the rest of the
engine never needs to know which one it got.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from ruvllm.config import ModelConfig
from ruvllm.errors import ModelNotFoundError, NotAModelError
from ruvllm.loader import hf_folder
from ruvllm.loader.checks import check_model, check_tokenizer
from ruvllm.loader.default_model import default_model_path
from ruvllm.loader.gguf_header import GGUF_MAGIC

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedTokenizerBase

    from ruvllm.quant.weights import QuantizedWeight

__all__ = [
    "ModelSource",
    "check_model",
    "default_model_path",
    "iter_weights",
    "load_model_config",
    "load_tokenizer",
    "resolve_model",
]


@dataclass(frozen=True)
class ModelSource:
    """What a user-supplied model path resolved to."""

    path: Path  # absolute; a GGUF file or a Hugging Face folder
    format: Literal["hf", "gguf"]


def _has_gguf_magic(path: Path) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(4) == GGUF_MAGIC
    except OSError:
        return False


def resolve_model(model: str | os.PathLike[str] | None) -> ModelSource:
    """Decide what `model` is. None means the embedded default GGUF."""
    if model is None:
        return ModelSource(default_model_path(), "gguf")
    path = Path(model).expanduser().absolute()
    if not path.exists():
        raise ModelNotFoundError(f"{path}: no such file or directory")
    if path.is_dir():
        if (path / hf_folder.CONFIG_FILE).is_file():
            if not hf_folder.has_weights(path):
                raise NotAModelError(
                    f"{path}: has config.json but no {hf_folder.SINGLE_WEIGHTS_FILE} or "
                    f"{hf_folder.INDEX_FILE} (only safetensors weights are supported)"
                )
            return ModelSource(path, "hf")
        ggufs = sorted(p for p in path.glob("*.gguf") if p.is_file())
        if len(ggufs) == 1:
            return resolve_model(ggufs[0])
        if len(ggufs) > 1:
            raise NotAModelError(f"{path}: holds {len(ggufs)} .gguf files; pass one of them")
        raise NotAModelError(f"{path}: not a model folder (no config.json and no .gguf file)")
    if _has_gguf_magic(path):
        return ModelSource(path, "gguf")
    raise NotAModelError(f"{path}: not a GGUF file (does not start with b'GGUF') and not a model folder")


def load_model_config(src: ModelSource) -> ModelConfig:
    """The model's config, once its files passed every check that needs no tensor data
    (loader/checks.py): a broken model fails here, in one line, before anything is allocated.
    The tokenizer is checked by load_tokenizer, so weights-only folders stay readable."""
    return check_model(src, tokenizer=False)


def iter_weights(src: ModelSource, dtype: torch.dtype,
                 keep_quantized: bool = False) -> Iterator[tuple[str, torch.Tensor | QuantizedWeight]]:
    """Yield (Hugging Face name, tensor) pairs, one tensor in memory at a time.

    When the model ties its embeddings, no lm_head.weight is yielded: use embed_tokens.
    keep_quantized: GGUF tensors with a packed kernel, and GPTQ/AWQ layers, come as QuantizedWeight.
    """
    # torch and the tensor readers only here: resolving, checking and reading a model's config (what an
    # API front does) need neither
    if src.format == "gguf":
        from ruvllm.loader import gguf_weights

        return gguf_weights.iter_weights(src.path, dtype, keep_quantized)
    from ruvllm.loader import hf_weights

    return hf_weights.iter_weights(src.path, dtype, keep_quantized)


def load_tokenizer(src: ModelSource) -> PreTrainedTokenizerBase:
    # transformers' tokenizer machinery (~1.5 s of CPU to import) only when a tokenizer is built: an engine
    # core builds one only for its first grammar, and its process starts without it.
    from ruvllm.loader.tokenizer import load_gguf_tokenizer, load_hf_tokenizer

    check_tokenizer(src)  # missing or cut tokenizer files: one line, not transformers' multi-line errors
    if src.format == "gguf":
        return load_gguf_tokenizer(src.path)
    return load_hf_tokenizer(src.path)
