"""One engine on the embedded default model, shared by the end-to-end tests (loading it takes ~10 s).

Every test that uses it ends by checking that it holds no request and every KV block is free."""

from __future__ import annotations

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


def assert_all_free(llm: LLM) -> None:
    assert llm.engine.num_free_blocks == llm.engine.num_blocks
