"""The disk KV tier through the server: the openai client's usage counts tokens loaded from disk as
cached, and /metrics counts each tier's hits, misses and bytes."""

from __future__ import annotations

import re
from collections.abc import Iterator

import httpx
import openai
import pytest

from ruvllm import LLM, CacheConfig
from ruvllm.server.app import create_app
from ruvllm.server.config import ServerConfig
from tests.conftest import novel_prompts
from tests.server.conftest import MODEL, free_port, serving


@pytest.fixture(scope="module")
def disk_server(_shared_llm: LLM, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, LLM]]:
    """A server whose engine has 20 blocks and a disk tier: a 260-token prompt evicts a 136-token one."""
    llm = _shared_llm.with_settings(cache=CacheConfig(num_blocks=20, kv_disk_path=str(tmp_path_factory.mktemp("kv"))))
    engine = llm.async_engine()
    port = free_port()
    try:
        with serving(create_app(engine, ServerConfig(port=port, served_model_name=MODEL)), port) as url:
            yield url, llm
            stats = engine.stats()
            assert stats.idle and stats.free_blocks == stats.total_blocks, "KV blocks leaked"
    finally:
        engine.shutdown()
        llm.close()


def metric(text: str, name: str) -> float:
    return sum(float(v) for v in re.findall(rf"^{re.escape(name)}\{{[^}}]*\}} (\S+)$", text, re.M))


def test_cached_tokens_and_metrics_count_the_disk_tier(disk_server: tuple[str, LLM], _shared_llm: LLM) -> None:
    url, llm = disk_server
    a, b = (_shared_llm.tokenizer.encode(p) for p in novel_prompts(2, words=400))
    a, b = a[:136], b[:260]
    client = openai.OpenAI(base_url=url + "/v1", api_key="x")

    def complete(prompt: list[int]):
        return client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0)

    first = complete(a)
    complete(b)  # evicts A's tail: written to disk
    llm.core.executor.kv_disk.flush()
    again = complete(a)
    assert again.choices[0].text == first.choices[0].text
    assert again.usage.prompt_tokens_details.cached_tokens == 128  # memory head + disk tail
    text = httpx.get(url + "/metrics").text
    disk_hits, memory_hits = metric(text, "ruvllm:kv_disk_hits_total"), metric(text, "ruvllm:prefix_cache_hits_total")
    assert disk_hits > 0 and memory_hits > 0 and disk_hits + memory_hits == 128
    assert metric(text, "ruvllm:kv_disk_misses_total") > 0  # B's blocks and A's first lookup
    assert metric(text, "ruvllm:prefix_cache_misses_total") > 0
    assert metric(text, "ruvllm:kv_disk_bytes") > 0
