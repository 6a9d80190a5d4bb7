"""One engine on the embedded default model, shared by the end-to-end and server tests (loading it takes ~10 s).

Every test that uses it ends by checking that it holds no request and every KV block is free."""

from __future__ import annotations

from pathlib import Path

import pytest

from ruvllm import LLM


@pytest.fixture(scope="session")
def _shared_llm() -> LLM:
    return LLM(dtype="float32", num_blocks=512, max_num_batched_tokens=512, max_num_seqs=64)


@pytest.fixture
def llm(_shared_llm: LLM):
    _shared_llm.engine.kv.pool.reset_prefix_cache()
    yield _shared_llm
    engine = _shared_llm.engine
    assert not engine.has_unfinished
    assert engine.num_free_blocks == engine.num_blocks, "KV blocks leaked"


BOOK = Path(__file__).resolve().parents[2] / "shared" / "data" / "pride-and-prejudice.txt"


def novel_prompts(n: int, words: int = 40) -> list[str]:
    """Realistic, distinct prompts cut from the novel in ../shared (or a stand-in when it is absent)."""
    if BOOK.exists():
        text = BOOK.read_text(encoding="utf-8").split()[2000:]
    else:
        text = ("It is a truth universally acknowledged that a single man in possession of a good fortune "
                "must be in want of a wife ").split() * 200
    return [" ".join(text[i * 97:i * 97 + words]) for i in range(n)]
