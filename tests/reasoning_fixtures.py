"""A tiny random model that a thinking model's chat template can run on: a byte-level tokenizer
(every text encodes, as a real BPE's does) with ChatML's special tokens and Qwen3's `<think>` and
`</think>` as added tokens (ids of their own, not special: Qwen3's own setup), under a tiny random
Llama. The chat templates are Qwen3's own (tests/server/fixtures/)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from ruvllm.engine.llm import LLM
from ruvllm.models.random_weights import random_weights
from tests.engine_fixtures import TINY_GQA

FIXTURES = Path(__file__).parent / "server" / "fixtures"
QWEN3_TEMPLATE = (FIXTURES / "qwen3.jinja").read_text()  # Qwen3-8B's: the model opens <think> itself
QWEN3_THINKING_TEMPLATE = (FIXTURES / "qwen3_thinking_2507.jinja").read_text()  # Qwen3-4B-Thinking-2507's: opened


def thinking_tokenizer() -> PreTrainedTokenizerFast:
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={ch: i for i, ch in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    tok.add_tokens(["<think>", "</think>"])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    fast.chat_template = QWEN3_TEMPLATE
    return fast


def write_thinking_model(folder: Path) -> Path:
    """The tiny random Llama over thinking_tokenizer, as a Hugging Face folder: structured outputs
    (the grammar compiler reads the tokenizer from the model's files) need a model from a path."""
    import torch

    from ruvllm.loader.hf_writer import folder_in_place, hf_config, save_tokenizer, write_safetensors

    tokenizer = thinking_tokenizer()
    cfg = dataclasses.replace(TINY_GQA, vocab_size=len(tokenizer), max_position_embeddings=2048,
                              eos_token_ids=(tokenizer.convert_tokens_to_ids("<|im_end|>"),))
    with folder_in_place(folder) as tmp:
        hf_config(cfg, torch.float32).save_pretrained(str(tmp))
        save_tokenizer(tokenizer, cfg, tmp)
        write_safetensors(random_weights(cfg, torch.float32, "cpu", seed=0, std=0.1), tmp)
    return folder


def thinking_llm(folder: Path) -> LLM:
    return LLM(str(write_thinking_model(folder)), dtype="float32", num_blocks=256, max_num_batched_tokens=256,
               max_num_seqs=16)
