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


def make_experts(base: Path) -> list[Path]:
    """Three adapters of different targets, ranks and scalings beside the base folder: X-LoRA's experts."""
    root = base.parent
    make_adapter(base, root / "e0", seed=11)
    make_adapter(base, root / "e1", seed=12, targets=["q_proj", "v_proj", "down_proj"], r=4)
    make_adapter(base, root / "e2", seed=13, targets=["o_proj", "gate_proj", "up_proj"], r=16, alpha=8)
    return [root / "e0", root / "e1", root / "e2"]


def make_xlora(base: Path | None, out: Path, adapters: list[Path], seed: int, model: torch.nn.Module | None = None,
               **settings: object) -> torch.nn.Module:
    """A peft X-LoRA model over `adapters` (peft 0.21.2 runs only adapters named "0", "1", ...)
    with a random classifier, saved to `out` as peft saves it; returns the peft model (the oracle,
    in eval mode: no dropout). The base: `model` (transformers', consumed), or the folder's."""
    from peft import XLoraConfig, get_peft_model

    model = model if model is not None else hf_model(base)
    model.config.use_cache = False  # peft's X-LoRA runs both passes over the whole sequence
    torch.manual_seed(seed)
    config = XLoraConfig(task_type="CAUSAL_LM", hidden_size=model.config.hidden_size,
                         adapters={str(i): str(p) for i, p in enumerate(adapters)}, **settings)
    xlora = get_peft_model(model, config)
    with torch.no_grad():  # logits of a few units, so the mixture is far from uniform
        for p in xlora.base_model.internal_xlora_classifier.parameters():
            p.mul_(8.0)
    xlora.save_pretrained(out)
    return xlora.eval()


def peft_logits(model: torch.nn.Module, prompt: list[int], continuation: list[int]) -> torch.Tensor:
    """peft's logits after the prompt and after each continuation token: [1 + len(continuation), V]."""
    with torch.no_grad():
        full = model(torch.tensor([prompt + continuation])).logits[0].float()
    return full[len(prompt) - 1:]


# A chat exchange on the embedded default model, as token ids: a prompt and a continuation to force.
DEFAULT_PROMPT = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 2114, 28, 7018, 411, 407, 19712, 8182, 2, 198]
DEFAULT_CONTINUATION = [504, 3458, 314, 1930, 28, 253]


def assert_default_model_follows(llm, adapter: str, ref: torch.nn.Module, base_logits: torch.Tensor,
                                 atol: float) -> None:
    """Our logits through `adapter` on the default exchange are peft's (`ref`) within atol, whole and
    prefilled in chunks of 7, with the same argmax; the adapter moves peft's logits (base_logits: without it)."""
    from tests.reference import teacher_forced_logits

    expected = peft_logits(ref, DEFAULT_PROMPT, DEFAULT_CONTINUATION)
    assert (expected - base_logits).abs().max() > 0.1, "the adapter must change the logits for the test to mean anything"
    for chunk in (None, 7):
        ours = teacher_forced_logits(llm.core.kv, llm.core.executor.runner, DEFAULT_PROMPT, DEFAULT_CONTINUATION,
                                     chunk, adapter)
        assert (ours - expected).abs().max().item() < atol
        assert torch.equal(ours.argmax(-1), expected.argmax(-1))


def nonzero_b(lora: object, scale: float, seed: int = 0) -> None:
    """Each B of a micro-LoRA drawn away from zero (seeded by its size, plus `seed`): at its initial
    zero, A's gradients are zero too and a gradient check would pass on half the parameters unseen."""
    with torch.no_grad():
        for _, b in lora.weights.values():  # type: ignore[attr-defined]
            draw = torch.Generator().manual_seed(b.numel() + seed)
            b.copy_(torch.randn(b.shape, generator=draw) * scale)
