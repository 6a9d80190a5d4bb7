"""Speculative decoding behind the server (prompt lookup on the default model), through the real
`openai` client: the streamed and plain greedy texts equal those of a server without it, and
/metrics carries the proposal counters."""

from __future__ import annotations

import re

import httpx
import openai
import pytest

from ruvllm import LLM
from ruvllm.config import SpeculativeConfig
from tests.conftest import novel_prompts
from tests.server.conftest import MODEL, RunningServer, start_server


@pytest.fixture(scope="module")
def spec_server(_default_llm: LLM):
    spec = _default_llm.with_settings(speculation=SpeculativeConfig(speculative="ngram", num_speculative_tokens=4))
    yield from start_server(spec)


@pytest.fixture(scope="module")
def plain_server(_default_llm: LLM):
    yield from start_server(_default_llm)


def _client(server: RunningServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)


def _metric(text: str, name: str) -> float:
    match = re.search(rf"^{re.escape(name)}(?:_total)?\{{[^}}]*\}} (\S+)$", text, re.M)
    assert match, f"{name} missing from /metrics"
    return float(match.group(1))


def test_greedy_text_and_metrics(spec_server: RunningServer, plain_server: RunningServer) -> None:
    ask = [{"role": "user", "content": "Repeat this passage word for word:\n\n" + novel_prompts(1, words=50)[0]}]
    texts = []
    for srv in (spec_server, plain_server):
        client = _client(srv)
        plain = client.chat.completions.create(model=MODEL, messages=ask, max_tokens=48, temperature=0)
        stream = client.chat.completions.create(model=MODEL, messages=ask, max_tokens=48, temperature=0, stream=True)
        streamed = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        assert streamed == plain.choices[0].message.content
        texts.append(plain.choices[0].message.content)
    assert texts[0] == texts[1]
    metrics = httpx.get(spec_server.url + "/metrics").text
    proposed = _metric(metrics, "ruvllm:spec_decode_num_draft_tokens")
    accepted = _metric(metrics, "ruvllm:spec_decode_num_accepted_tokens")
    assert 0 < accepted <= proposed
    rate = _metric(metrics, "ruvllm:spec_decode_acceptance_rate")
    assert rate == pytest.approx(accepted / proposed, rel=1e-6)
    assert _metric(metrics, "ruvllm:spec_decode_mean_accepted_length") > 1.0
