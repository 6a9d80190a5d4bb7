"""Random weights and a stand-in tokenizer for a model shape: benchmarks of large models (Llama-3-8B
and the like) without their files, created directly on the device."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from ruvllm.config import ModelConfig


def random_weights(cfg: ModelConfig, dtype: torch.dtype, device: torch.device | str, seed: int = 0,
                   std: float = 0.02) -> Iterator[tuple[str, torch.Tensor]]:
    """Hugging Face-named tensors of a Llama-family or Gemma 3 model: normal(0, std) matrices, unit norms."""
    g = torch.Generator(device=device).manual_seed(seed)

    def normal(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=g, device=device, dtype=dtype) * std

    def ones(n: int) -> torch.Tensor:  # a norm that scales by 1 (Gemma's weights mean 1 + w)
        return torch.full((n,), 0.0 if cfg.architecture == "gemma3" else 1.0, device=device, dtype=dtype)

    h, i, d = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    yield "model.embed_tokens.weight", normal(cfg.vocab_size, h)
    for layer in range(cfg.num_layers):
        p = f"model.layers.{layer}."
        yield p + "input_layernorm.weight", ones(h)
        for name, rows in (("q_proj", cfg.q_size), ("k_proj", cfg.kv_size), ("v_proj", cfg.kv_size)):
            yield p + f"self_attn.{name}.weight", normal(rows, h)
            if cfg.attention_bias:
                yield p + f"self_attn.{name}.bias", normal(rows)
        if cfg.qk_norm:
            yield p + "self_attn.q_norm.weight", ones(d)
            yield p + "self_attn.k_norm.weight", ones(d)
        yield p + "self_attn.o_proj.weight", normal(h, cfg.q_size)
        yield p + "post_attention_layernorm.weight", ones(h)
        yield p + "mlp.gate_proj.weight", normal(i, h)
        yield p + "mlp.up_proj.weight", normal(i, h)
        yield p + "mlp.down_proj.weight", normal(h, i)
        if cfg.architecture == "gemma3":
            yield p + "pre_feedforward_layernorm.weight", ones(h)
            yield p + "post_feedforward_layernorm.weight", ones(h)
    yield "model.norm.weight", ones(h)
    if not cfg.tie_word_embeddings:
        yield "lm_head.weight", normal(cfg.vocab_size, h)


@dataclass(frozen=True)
class RandomWeights:
    """random_weights on the CPU as a weights function of the dtype alone that pickles: what
    Worker.from_weights takes, also for tensor parallelism, whose rank processes draw the same
    weights from the same seed and keep their slices."""

    cfg: ModelConfig
    seed: int = 0
    std: float = 0.02

    def __call__(self, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
        return random_weights(self.cfg, dtype, "cpu", self.seed, self.std)


def word_tokenizer(vocab_size: int) -> PreTrainedTokenizerFast:
    """One word per token id ("t0" ... "tN"), split on whitespace; id 0 is end-of-sequence. Its chat
    template writes each message as its role and content, so chat requests run too."""
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t1"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="t0", unk_token="t1")
    fast.chat_template = ("{% for m in messages %}{{ m['role'] }} {{ m['content'] }} {% endfor %}"
                          "{% if add_generation_prompt %}assistant {% endif %}")
    return fast
