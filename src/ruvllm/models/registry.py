"""Architecture name -> model class, and building a model with its weights loaded."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from ruvllm.config import SUPPORTED_ARCHITECTURES, ModelConfig
from ruvllm.errors import UnsupportedArchitectureError
from ruvllm.layers.rotary import RotaryEmbedding
from ruvllm.models.llama import LlamaForCausalLM

_MODELS = {arch: LlamaForCausalLM for arch in SUPPORTED_ARCHITECTURES}


def build_model(cfg: ModelConfig, weights: Iterable[tuple[str, torch.Tensor]], source: str,
                max_positions: int, dtype: torch.dtype, device: torch.device | str = "cpu") -> LlamaForCausalLM:
    cls = _MODELS.get(cfg.architecture)
    if cls is None:
        raise UnsupportedArchitectureError(f"{source}: unsupported architecture {cfg.architecture!r}")
    rope = RotaryEmbedding(cfg.head_dim, max_positions, cfg.rope_theta, cfg.rope_scaling, dtype, device)
    # Built on the meta device so no memory is spent on random initial weights; loading fills them.
    with torch.device("meta"):
        model = cls(cfg, rope)
    model = model.to(dtype).to_empty(device=device)
    model.load_hf_weights(weights, source)
    return model.eval()
