"""A model written as a Hugging Face folder (config.json, tokenizer, safetensors): `ruvllm export`,
and the bf16/f16 variants `ruvllm download MODEL:bf16` converts."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from ruvllm.loader import ModelSource

if TYPE_CHECKING:
    import torch

EXPORT_DTYPES = ("auto", "float32", "bfloat16", "float16")


def export(src: ModelSource, out: Path, *, tokenizer_only: bool = False, dtype: str = "auto") -> None:
    """Build the folder beside `out` and rename it into place, so a failure leaves nothing half-written."""
    from ruvllm.loader import load_model_config, load_tokenizer
    from ruvllm.loader.hf_writer import folder_in_place, hf_config, save_tokenizer, write_safetensors

    cfg = load_model_config(src)  # first: an unsupported model fails before anything is written
    torch_dtype = _export_dtype(src, dtype)
    tokenizer = load_tokenizer(src)
    with folder_in_place(out) as tmp:
        hf_config(cfg, torch_dtype).save_pretrained(str(tmp))
        save_tokenizer(tokenizer, cfg, tmp)
        if not tokenizer_only:
            from ruvllm.loader import iter_weights

            write_safetensors(iter_weights(src, torch_dtype), tmp)


def _export_dtype(src: ModelSource, name: str) -> torch.dtype:
    import torch

    if name == "auto":
        name = "float32"  # GGUF: dequantized values are exact in float32, not in 16-bit types
        if src.format == "hf":
            from ruvllm.loader import hf_folder

            cfg = hf_folder.read_config_json(src.path)
            declared = cfg.get("dtype") or cfg.get("torch_dtype")
            if declared in EXPORT_DTYPES[1:]:
                name = declared  # keep the checkpoint's own precision: an exact copy
    return getattr(torch, name)
