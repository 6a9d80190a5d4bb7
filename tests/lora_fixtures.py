"""LoRA adapters made with peft at test time, over the tiny model's Hugging Face folder."""

from __future__ import annotations

from pathlib import Path

import torch

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def hf_model(base: Path) -> torch.nn.Module:
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(base, dtype=torch.float32).eval()


def make_adapter(base: Path, out: Path, seed: int, targets: list[str] = ALL, r: int = 8, alpha: int = 16,
                 **extra: object) -> torch.nn.Module:
    """A peft adapter with random non-zero A and B (`init_lora_weights=False`), saved to `out`;
    returns the peft model (the oracle)."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    model = get_peft_model(hf_model(base), LoraConfig(r=r, lora_alpha=alpha, target_modules=targets,
                                                      init_lora_weights=False, **extra))
    model.save_pretrained(out)
    return model.eval()
