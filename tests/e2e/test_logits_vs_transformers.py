"""Our logits == transformers' logits on the same weights (fp32): prefill and 32 decode steps."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

from ruvllm.loader import resolve_model
from tests.reference import DirectRunner, hf_logits, hf_reference

ATOL = 2e-4
DECODE_STEPS = 32


def _check(src, prompt: list[int], chunk: int | None = None, reference=None) -> None:
    """`reference`: a folder whose tensors transformers loads instead of src's (a dense twin)."""
    ref = hf_reference(reference or src)
    # The continuation is transformers' own greedy choice, fed back token by token to both models.
    with torch.no_grad():
        full = ref.generate(torch.tensor([prompt]), max_new_tokens=DECODE_STEPS, do_sample=False,
                            min_new_tokens=DECODE_STEPS)[0].tolist()
    continuation = full[len(prompt):]
    expected = hf_logits(ref, full)[len(prompt) - 1:-1]  # logits predicting each continuation token
    ours = DirectRunner(src).prefill_then_decode(prompt, continuation[:-1], chunk=chunk)
    assert ours.shape == expected.shape
    diff = (ours - expected).abs().max().item()
    assert diff < ATOL, f"max |logit diff| {diff:.2e}"
    assert torch.equal(ours.argmax(-1), expected.argmax(-1))


def test_default_model_logits_match_transformers() -> None:
    src = resolve_model(None)
    prompt = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 2114, 28, 7018, 411, 407, 19712, 8182, 2, 198]
    _check(src, prompt)


def _save(model: torch.nn.Module, path: Path) -> Path:
    torch.manual_seed(0)
    model.save_pretrained(path)
    return path


TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            max_position_embeddings=256)


@pytest.mark.parametrize("kind", ["llama-gqa-llama3rope", "llama-mqa", "qwen2", "qwen3", "gemma3"])
def test_tiny_random_models_match_transformers(tmp_path: Path, kind: str) -> None:
    torch.manual_seed(0)
    if kind == "llama-gqa-llama3rope":
        cfg = LlamaConfig(**TINY, num_key_value_heads=2, rope_theta=500000.0, tie_word_embeddings=False,
                          rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                        "high_freq_factor": 4.0, "original_max_position_embeddings": 32})
        model = LlamaForCausalLM(cfg)
    elif kind == "llama-mqa":
        model = LlamaForCausalLM(LlamaConfig(**TINY, num_key_value_heads=1, tie_word_embeddings=True))
    elif kind == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**TINY, num_key_value_heads=2, tie_word_embeddings=True))
    elif kind == "qwen3":
        model = Qwen3ForCausalLM(Qwen3Config(**TINY, num_key_value_heads=2, head_dim=32, tie_word_embeddings=False))
    else:
        # Gemma 3 with a window of 8 (the prompt is 40 tokens), a global layer between sliding
        # ones, its own attention scalar and a final soft-cap; norms drawn away from their zero init.
        from transformers import Gemma3ForCausalLM, Gemma3TextConfig

        model = Gemma3ForCausalLM(Gemma3TextConfig(
            **{**TINY, "num_hidden_layers": 4}, num_key_value_heads=2, head_dim=32, sliding_window=8,
            layer_types=["sliding_attention", "full_attention", "sliding_attention", "sliding_attention"],
            query_pre_attn_scalar=24, final_logit_softcapping=30.0,
            rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                             "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}))
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("norm.weight"):
                    p.normal_(0.0, 0.3)
    # Random init gives tiny logits; scale the output so argmax is not decided by rounding noise.
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(20.0)
    src = resolve_model(_save(model, tmp_path / kind))
    prompt = torch.randint(0, 512, (40,)).tolist()
    _check(src, prompt)
    _check(src, prompt, chunk=7)  # chunked prefill through the paged cache gives the same logits
