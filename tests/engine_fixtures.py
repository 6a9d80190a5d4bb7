"""Engines over tiny random Llama models built in memory (no files), on any device."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from ruvllm.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from ruvllm.core.engine_core import EngineCore
from ruvllm.engine.llm import LLM
from ruvllm.models.random_weights import random_weights, word_tokenizer
from ruvllm.worker.worker import Worker

TINY_GQA = ModelConfig("llama", vocab_size=512, hidden_size=128, intermediate_size=256, num_layers=2, num_heads=4,
                       num_kv_heads=2, head_dim=32, rms_norm_eps=1e-5, rope_theta=10000.0,
                       max_position_embeddings=512, tie_word_embeddings=False, eos_token_ids=(0,))


def tiny_llm(device: str, dtype: str = "float32", cfg: ModelConfig = TINY_GQA, **engine: object) -> LLM:
    """Weights drawn in fp32 from a fixed seed on the CPU, then cast and moved, so every device and
    dtype gets the same model (drawn directly in bf16 the draws differ). std 0.1 gives logits with
    clear argmax margins (0.02 would leave ties to rounding noise)."""
    import torch

    cache = CacheConfig(num_blocks=engine.pop("num_blocks", 128))  # type: ignore[arg-type]
    sched = SchedulerConfig(max_num_batched_tokens=256, max_num_seqs=32)
    config = dataclasses.replace(EngineConfig(device=device, dtype=dtype, cache=cache, scheduler=sched), **engine)

    def weights(dt):
        return ((n, t.to(device, dt)) for n, t in random_weights(cfg, torch.float32, "cpu", seed=0, std=0.1))

    return LLM.from_core(EngineCore(Worker.from_weights(cfg, weights, config), config), word_tokenizer(cfg.vocab_size))


def write_tiny_model(folder: Path, cfg: ModelConfig = TINY_GQA, max_positions: int = 4096, seed: int = 0) -> Path:
    """The tiny model tiny_llm builds (the same weights) as a Hugging Face folder with the word
    tokenizer: for what runs a model from a path (`ruvllm serve`, `benchmark`, the core process)
    where the real model is not the point. A longer context than TINY_GQA's lets a stream outlast a
    signal sent mid-reply (RoPE angles at a position do not depend on the table's length)."""
    import torch

    from ruvllm.loader.hf_writer import folder_in_place, hf_config, save_tokenizer, write_safetensors

    cfg = dataclasses.replace(cfg, max_position_embeddings=max_positions)
    with folder_in_place(folder) as tmp:
        hf_config(cfg, torch.float32).save_pretrained(str(tmp))
        save_tokenizer(word_tokenizer(cfg.vocab_size), cfg, tmp)
        write_safetensors(random_weights(cfg, torch.float32, "cpu", seed=seed, std=0.1), tmp)
    return folder


def is_tiny(llm: LLM) -> bool:
    return llm.info.vocab_size == TINY_GQA.vocab_size


def prompt_ids(llm: LLM, n: int, words: int = 40) -> list[list[int]]:
    """n distinct prompts as token ids: the novel's text, tokenized, for a real model; for the tiny
    model (whose word tokenizer knows no English: every word would be one unknown id) random ids,
    about as many as the text's tokens (~1.3 per word). Prompt i is the same whatever n is."""
    if not is_tiny(llm):
        from tests.conftest import novel_prompts

        return [llm.tokenizer.encode(p) for p in novel_prompts(n, words)]
    import random

    length = max(1, round(1.3 * words))
    return [[random.Random(1000 * words + i).randrange(2, llm.info.vocab_size) for _ in range(length)]
            for i in range(n)]


def more_ids(llm: LLM, text: str) -> list[int]:
    """A few tokens to append to a prompt: `text` tokenized, or ids derived from it for the tiny model."""
    if not is_tiny(llm):
        return llm.tokenizer.encode(text, add_special_tokens=False)
    return [2 + sum(map(ord, word)) % (llm.info.vocab_size - 2) for word in text.split()]


def llm_with_tokenizer(model: str, tokenizer: object, **settings: object) -> LLM:
    """`LLM(model, **settings)` with a tokenizer already loaded: the core built as LLM builds it, taken
    with its tokenizer (LLM's built-parts form). For a model whose tokenizer is slow to load (Gemma 3's
    262,144 tokens: ~5 s of CPU each time) and that a test file runs in several engines."""
    from ruvllm.engine.llm import build_engine_config

    config = build_engine_config(model, **settings)
    return LLM(EngineCore(Worker.load(config), config), tokenizer)
