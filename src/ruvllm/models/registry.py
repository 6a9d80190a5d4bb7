"""Architecture name -> model class, and building a model with its weights loaded."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from ruvllm.config import SUPPORTED_ARCHITECTURES, ModelConfig, QuantConfig
from ruvllm.errors import UnsupportedArchitectureError
from ruvllm.layers.ops import select_ops
from ruvllm.layers.rotary import RotaryEmbedding
from ruvllm.models.gemma3 import Gemma3ForCausalLM
from ruvllm.models.llama import LlamaForCausalLM
from ruvllm.models.weight_plan import WeightPlan, float_weight_plan
from ruvllm.quant.plan import Weight

_MODELS: dict[str, type[LlamaForCausalLM]] = {arch: LlamaForCausalLM for arch in SUPPORTED_ARCHITECTURES}
_MODELS["gemma3"] = Gemma3ForCausalLM


def build_model(cfg: ModelConfig, weights: Iterable[tuple[str, Weight]], source: str,
                max_positions: int, dtype: torch.dtype, device: torch.device | str = "cpu",
                quant: QuantConfig | None = None, plan: WeightPlan | None = None) -> LlamaForCausalLM:
    """The model with `weights` loaded as `plan` says (models/weight_plan.py); without a plan, as
    float weights held with `quant`."""
    cls = model_class(cfg, source)
    if plan is None:
        plan = float_weight_plan(cfg, quant, dtype, device, source)
    elif plan.dtype != dtype:
        raise ValueError(f"the weight plan is for {plan.dtype}, the model for {dtype}")
    rope = RotaryEmbedding(cfg.head_dim, max_positions, cfg.rope_theta, cfg.rope_scaling, dtype, device)
    extra = {}
    if cfg.rope_local_theta is not None:  # sliding-window layers' own base (Gemma 3)
        extra["local_rope"] = RotaryEmbedding(cfg.head_dim, max_positions, cfg.rope_local_theta, None, dtype, device)
    # Built on the meta device so no memory is spent on random initial weights; loading fills them.
    with torch.device("meta"):
        model = cls(cfg, rope, select_ops(torch.device(device)), **extra)
    model.load_weights(weights, plan, torch.device(device))
    return model.eval()


def model_class(cfg: ModelConfig, source: str) -> type[LlamaForCausalLM]:
    cls = _MODELS.get(cfg.architecture)
    if cls is None:
        raise UnsupportedArchitectureError(f"{source}: unsupported architecture {cfg.architecture!r}")
    return cls


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes held by the model's weights: dense parameters plus packed quantized ones."""
    dense = sum(p.numel() * p.element_size() for p in model.parameters())
    packed = sum(b.numel() * b.element_size() for b in model.buffers())
    return dense + packed
