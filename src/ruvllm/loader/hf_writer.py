"""Writing Hugging Face model folders: config.json, tokenizer files, safetensors weights, and the
build-beside-then-rename step that keeps a failed write from leaving half a folder.

Shared by `ruvllm export` (cli/models_cmd.py) and `ruvllm quantize` (quantize/awq_writer.py).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch

from ruvllm.config import ModelConfig

# Hugging Face class names for the architectures ruvllm runs (config.json "architectures").
HF_MODEL_CLASSES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
}
# config.json's model_type, where it is not the architecture's name
HF_MODEL_TYPES = {"gemma3": "gemma3_text"}
# Shards of at most this many bytes: a writer never holds more than one shard in memory.
SHARD_BYTES = 2 * 1024**3


@contextlib.contextmanager
def folder_in_place(out: Path, replace: bool = False) -> Iterator[Path]:
    """Yield a fresh folder beside `out` to write into; on success it is renamed to `out`, on any
    failure removed. `out` must not exist or be an empty directory, unless `replace`: then an
    existing `out` is removed once the new folder is complete."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.partial-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        yield tmp
        if out.is_dir() and replace:
            shutil.rmtree(out)
        elif out.exists():
            out.rmdir()  # empty, checked by the caller
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def hf_config(cfg: ModelConfig, dtype: torch.dtype) -> Any:
    """A transformers config object for cfg, built by transformers itself so the JSON matches the
    installed version's conventions (e.g. rope_parameters in transformers 5)."""
    from transformers import CONFIG_MAPPING

    kwargs: dict[str, Any] = dict(
        architectures=[HF_MODEL_CLASSES[cfg.architecture]],
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
        rms_norm_eps=cfg.rms_norm_eps,
        rope_theta=cfg.rope_theta,
        rope_scaling=dict(cfg.rope_scaling) if cfg.rope_scaling else None,
        max_position_embeddings=cfg.max_position_embeddings,
        tie_word_embeddings=cfg.tie_word_embeddings,
        bos_token_id=cfg.bos_token_id,
        eos_token_id=(cfg.eos_token_ids[0] if len(cfg.eos_token_ids) == 1 else list(cfg.eos_token_ids) or None),
        dtype=str(dtype).removeprefix("torch."),
    )
    if cfg.architecture != "qwen2":  # Qwen2 always has q/k/v biases and no flag for it
        kwargs["attention_bias"] = cfg.attention_bias
    if cfg.architecture in ("mistral", "qwen2", "qwen3"):
        # ruvllm attends over the full context; say so, rather than inherit a window default.
        kwargs["sliding_window"] = None
    if cfg.architecture in ("qwen2", "qwen3"):
        kwargs["use_sliding_window"] = False
    if cfg.architecture == "gemma3":
        del kwargs["rope_theta"], kwargs["rope_scaling"]
        full = {"rope_type": "default", **(cfg.rope_scaling or {}), "rope_theta": cfg.rope_theta}
        kwargs.update(
            layer_types=["sliding_attention" if i in cfg.sliding_layers else "full_attention"
                         for i in range(cfg.num_layers)],
            sliding_window=cfg.sliding_window,
            rope_parameters={"full_attention": full, "sliding_attention": {
                "rope_type": "default", "rope_theta": cfg.rope_local_theta or cfg.rope_theta}},
            query_pre_attn_scalar=cfg.query_pre_attn_scalar or cfg.head_dim,
            final_logit_softcapping=cfg.final_logit_softcapping,
            hidden_activation="gelu_pytorch_tanh",
        )
    return CONFIG_MAPPING[HF_MODEL_TYPES.get(cfg.architecture, cfg.architecture)](**kwargs)


def save_tokenizer(tokenizer: Any, cfg: ModelConfig, folder: Path) -> None:
    # GGUF metadata carries no model_max_length; without it transformers writes a 1e30 placeholder.
    if getattr(tokenizer, "model_max_length", 0) > cfg.max_position_embeddings:
        tokenizer.model_max_length = cfg.max_position_embeddings
    tokenizer.save_pretrained(str(folder))
    # Our load-time options (local_files_only=True, ...) end up in tokenizer_config.json; they are
    # not properties of the tokenizer and would constrain whoever loads the export later.
    path = folder / "tokenizer_config.json"
    if path.is_file():
        data = json.loads(path.read_text(encoding="utf-8"))
        for key in ("local_files_only", "is_local", "gguf_file"):
            data.pop(key, None)
        path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def write_safetensors(weights: Iterable[tuple[str, torch.Tensor]], folder: Path) -> None:
    """Stream tensors into model.safetensors, or into shards + index when over SHARD_BYTES."""
    from safetensors.torch import save_file

    shards: list[tuple[Path, list[str]]] = []
    current: dict[str, Any] = {}
    size = total = 0

    def flush() -> None:
        file = folder / f"shard-{len(shards) + 1:05d}.tmp"
        save_file(current, str(file), metadata={"format": "pt"})  # transformers wants format=pt
        # safetensors creates the file 0600; give it the umask's mode like the folder's other files.
        os.chmod(file, folder.stat().st_mode & 0o666)
        shards.append((file, list(current)))

    for name, tensor in weights:
        nbytes = tensor.numel() * tensor.element_size()
        if current and size + nbytes > SHARD_BYTES:
            flush()
            current, size = {}, 0
        current[name] = tensor.contiguous()
        size += nbytes
        total += nbytes
    if current or not shards:
        flush()
    if len(shards) == 1:
        shards[0][0].rename(folder / "model.safetensors")
        return
    weight_map: dict[str, str] = {}
    for i, (file, names) in enumerate(shards, start=1):
        final = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        file.rename(folder / final)
        weight_map.update(dict.fromkeys(names, final))
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n", encoding="utf-8")
