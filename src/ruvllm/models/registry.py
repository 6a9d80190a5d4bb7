"""Architecture name -> model class, and building a model with its weights loaded."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from ruvllm.config import SUPPORTED_ARCHITECTURES, ModelConfig, QuantConfig
from ruvllm.errors import UnsupportedArchitectureError
from ruvllm.layers.ops import select_ops
from ruvllm.layers.rotary import RotaryEmbedding
from ruvllm.models.llama import LlamaForCausalLM
from ruvllm.quant.plan import Weight

_MODELS = {arch: LlamaForCausalLM for arch in SUPPORTED_ARCHITECTURES}


def build_model(cfg: ModelConfig, weights: Iterable[tuple[str, Weight]], source: str,
                max_positions: int, dtype: torch.dtype, device: torch.device | str = "cpu",
                quant: QuantConfig | None = None) -> LlamaForCausalLM:
    cls = _MODELS.get(cfg.architecture)
    if cls is None:
        raise UnsupportedArchitectureError(f"{source}: unsupported architecture {cfg.architecture!r}")
    rope = RotaryEmbedding(cfg.head_dim, max_positions, cfg.rope_theta, cfg.rope_scaling, dtype, device)
    # Built on the meta device so no memory is spent on random initial weights; loading fills them.
    with torch.device("meta"):
        model = cls(cfg, rope, select_ops(torch.device(device)))
    model.load_weights(weights, source, quant or QuantConfig(), dtype, torch.device(device))
    return model.eval()


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes held by the model's weights: dense parameters plus packed quantized ones."""
    dense = sum(p.numel() * p.element_size() for p in model.parameters())
    packed = sum(b.numel() * b.element_size() for b in model.buffers())
    return dense + packed
