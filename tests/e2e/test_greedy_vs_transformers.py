"""Greedy text from the engine == transformers' greedy generate on the same weights."""

from __future__ import annotations

import pytest
import torch

from ruvllm import LLM, SamplingParams
from ruvllm.loader import resolve_model
from tests.reference import hf_reference

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "It is a truth universally acknowledged, that a single man in possession of a good fortune,",
    "List three colours:",
]
CHAT = [{"role": "user", "content": "What is 2 + 2?"}]
NEW_TOKENS = 24


@pytest.fixture(scope="module")
def ref() -> torch.nn.Module:
    return hf_reference(resolve_model(None))


def test_greedy_matches_transformers(llm: LLM, ref: torch.nn.Module) -> None:
    tok = llm.tokenizer
    prompts = [tok.encode(p) for p in PROMPTS]
    prompts.append(tok.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=True, return_dict=False))
    ref.generation_config.eos_token_id = list(llm.eos_token_ids)
    ref.generation_config.pad_token_id = llm.eos_token_ids[0]
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS)
    outs = llm.generate([list(p) for p in prompts], params)
    for prompt, out in zip(prompts, outs):
        with torch.no_grad():
            expected = ref.generate(torch.tensor([list(prompt)]), max_new_tokens=NEW_TOKENS, do_sample=False)[0, len(prompt):].tolist()
        assert out.outputs[0].token_ids == expected, tok.decode(list(prompt))
        assert out.outputs[0].finish_reason == ("stop" if expected[-1] in llm.eos_token_ids else "length")
        assert out.outputs[0].text == tok.decode(expected, skip_special_tokens=True)


def test_prompt_logprobs_match_transformers_chunked_or_not(llm: LLM, ref: torch.nn.Module) -> None:
    from ruvllm import SchedulerConfig
    from tests.reference import hf_logits
    prompt = llm.tokenizer.encode(PROMPTS[2] + " " + PROMPTS[0])
    expected = hf_logits(ref, prompt).log_softmax(-1)
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=2)
    chunked = llm.with_settings(scheduler=SchedulerConfig(max_num_batched_tokens=7))
    for engine in (llm, chunked):
        out = engine.generate([prompt], params)[0]
        lps = out.prompt_logprobs
        assert lps is not None and len(lps) == len(prompt) and lps[0] is None
        for pos in range(1, len(prompt)):
            entry = lps[pos]
            tok = prompt[pos]
            assert abs(entry[tok].logprob - expected[pos - 1, tok].item()) < 1e-4
            top2 = expected[pos - 1].topk(2).indices.tolist()
            assert set(top2) <= set(entry)
            assert entry[tok].rank == int((expected[pos - 1] > expected[pos - 1, tok]).sum()) + 1
