"""What tensor parallelism runs, checked at load before any rank process starts.

It shards dense weights in the Python layer loop of the Llama family. Each of the following has a
path of its own that the sharded model does not take, and is refused by name rather than run
unsharded or wrong: packed weights (int4/int8 codes, W8A8, a tied head's packed copy: their kernels
and layouts split differently), LoRA adapters (their deltas would need the same split), speculative
decoding (a draft model and the cost measurements run the whole model on one rank), the int8/int4
KV tiers (cold-block moves are not broadcast), and Gemma 3 (its sliding-window KV groups and its
own modules). The C++ whole-layer loop is not refused: the sharded model keeps the Python loop, so
the all-reduces sit between its layers' halves.
"""

from __future__ import annotations

import torch

from ruvllm.config import EngineConfig, ModelConfig
from ruvllm.models.weight_plan import WeightPlan
from ruvllm.parallel.layout import layout_refusal

# Architectures whose model is LlamaForCausalLM (registry.py), the class the sharded model extends.
TENSOR_PARALLEL_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3")


def check_tensor_parallel(config: EngineConfig, cfg: ModelConfig, plan: WeightPlan, device: torch.device,
                          model: str) -> None:
    """ValueError in one line naming every setting or weight form tensor parallelism cannot run,
    or why the model's shape does not split across the ranks."""
    size = config.tensor_parallel_size
    refused = []
    if cfg.architecture not in TENSOR_PARALLEL_ARCHITECTURES:
        refused.append(f"a {cfg.architecture} model (supported: {', '.join(TENSOR_PARALLEL_ARCHITECTURES)})")
    packed = {form: n for form, n in plan.linear_forms().items() if not form.startswith("dense")}
    if packed:
        forms = ", ".join(f"{n} {form}" for form, n in packed.items())
        refused.append(f"packed weights ({forms} linears under quantization {plan.quant.method}; "
                       "pass quantization none, bf16 or f16)")
    if config.lora.enable_lora:
        refused.append("LoRA adapters (enable_lora)")
    if config.speculation.method is not None:
        refused.append(f"speculative decoding ({config.speculation.method})")
    if config.cache.quantized_kv:
        refused.append(f"an {config.cache.kv_cache_dtype} KV cache (kv_cache_dtype; use auto)")
    reasons = [f"cannot run {'; '.join(refused)}"] if refused else []
    layout = layout_refusal(cfg, size, model)
    if layout is not None:
        reasons.append(layout)
    if reasons:  # all of them at once: one fix each, not one per attempt
        raise ValueError(f"tensor_parallel_size {size} {', and '.join(reasons)}")
    if device.type == "cuda":
        first = device.index or 0
        have = torch.cuda.device_count()
        if first + size > have:
            raise ValueError(f"tensor_parallel_size {size} needs {size} GPUs from cuda:{first} on (one per rank); "
                             f"this machine has {have}")
