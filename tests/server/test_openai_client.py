"""The server through the real `openai` Python client: sync, async, streaming; chat and completions."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from ruvllm import LLM, SamplingParams
from tests.server.conftest import MODEL, RunningServer


@pytest.fixture
def client(server: RunningServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]


def test_chat_matches_the_offline_engine(client: openai.OpenAI, _shared_llm: LLM) -> None:
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=0, max_tokens=24)
    offline = _shared_llm.chat(MESSAGES, SamplingParams(temperature=0, max_tokens=24))[0]
    assert r.choices[0].message.content == offline.outputs[0].text
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].finish_reason == offline.outputs[0].finish_reason.value
    assert r.usage.prompt_tokens == len(offline.prompt_token_ids)
    assert r.usage.completion_tokens == len(offline.outputs[0].token_ids)
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    assert r.model == MODEL and r.object == "chat.completion"


def test_chat_stream_equals_non_stream_and_reports_usage(client: openai.OpenAI) -> None:
    whole = client.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=0, max_tokens=30)
    stream = client.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=0, max_tokens=30,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [whole.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert all(c.usage is None for c in chunks[:-1])


def test_sampling_fields_are_honoured(client: openai.OpenAI) -> None:
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "Write a poem about the sea."}], max_tokens=20)
    sampled = dict(**kw, temperature=1.0, top_p=0.9, seed=42, presence_penalty=0.5, frequency_penalty=0.5,
                   extra_body={"top_k": 40, "min_p": 0.05, "repetition_penalty": 1.1})
    calls = {"a": sampled, "b": sampled, "n3": dict(**kw, temperature=1.0, n=3, seed=1),
             "stop": dict(model=MODEL, messages=MESSAGES, temperature=0, max_tokens=30, stop=["Paris"]),
             "ignore": dict(model=MODEL, messages=MESSAGES, temperature=0, max_completion_tokens=40,
                            extra_body={"ignore_eos": True}),
             "mint": dict(model=MODEL, messages=MESSAGES, temperature=0, max_tokens=60,
                          extra_body={"min_tokens": 50})}
    # All at once: they share the engine's steps, which each must survive (and it is faster).
    with ThreadPoolExecutor(len(calls)) as pool:
        futures = {name: pool.submit(client.chat.completions.create, **body) for name, body in calls.items()}
        r = {name: f.result() for name, f in futures.items()}
    assert r["a"].choices[0].message.content == r["b"].choices[0].message.content  # same seed, same text
    assert sorted(c.index for c in r["n3"].choices) == [0, 1, 2]
    stop = r["stop"].choices[0]
    assert "Paris" not in stop.message.content and stop.finish_reason == "stop"
    assert r["ignore"].usage.completion_tokens == 40 and r["ignore"].choices[0].finish_reason == "length"
    assert r["mint"].usage.completion_tokens >= 50


def test_chat_logprobs(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=0, max_tokens=8,
                                       logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    for entry in content:
        assert len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].logprob == entry.logprob  # greedy: the chosen token is the top one
        assert bytes(entry.bytes).decode("utf-8", errors="replace") == entry.token


def test_completions_prompt_forms(client: openai.OpenAI, _shared_llm: LLM) -> None:
    ids = _shared_llm.tokenizer.encode("The capital of France is")
    by_text = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=8, temperature=0)
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=8, temperature=0)
    assert by_text.choices[0].text == by_ids.choices[0].text
    many = client.completions.create(model=MODEL, prompt=["The capital of France is", "Once upon a time"],
                                     max_tokens=8, temperature=0, n=2)
    assert [c.index for c in sorted(many.choices, key=lambda c: c.index)] == [0, 1, 2, 3]
    assert many.choices[0].text == by_text.choices[0].text
    ids_lists = client.completions.create(model=MODEL, prompt=[ids, ids[:3]], max_tokens=4, temperature=0)
    assert len(ids_lists.choices) == 2 and ids_lists.usage.prompt_tokens == len(ids) + 3


def test_completions_echo_with_logprobs_scores_the_prompt(client: openai.OpenAI, _shared_llm: LLM) -> None:
    prompt = "It is a truth universally acknowledged"
    n_prompt = len(_shared_llm.tokenizer.encode(prompt))
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=3, temperature=0, echo=True, logprobs=2)
    lp = r.choices[0].logprobs
    assert r.choices[0].text.startswith(prompt)
    assert len(lp.tokens) == n_prompt + 3
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(x is not None and x <= 0 for x in lp.token_logprobs[1:])
    assert all(len(t) >= 1 for t in lp.top_logprobs[1:])
    assert lp.text_offset == sorted(lp.text_offset)
    # scoring only: max_tokens=1 with echo gives the prompt's logprobs (evaluation harnesses do this)
    score = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, echo=True, logprobs=0)
    assert score.choices[0].logprobs.token_logprobs[1:n_prompt] == lp.token_logprobs[1:n_prompt]


def test_completions_stream(client: openai.OpenAI) -> None:
    whole = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=20, temperature=0)
    chunks = list(client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=20,
                                            temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text
    assert chunks[-1].choices[0].finish_reason == "length"


def test_async_client_concurrent_requests(server: RunningServer, _shared_llm: LLM) -> None:
    prompts = [f"Tell me a fact about the number {i}." for i in range(8)]
    expected = [o.outputs[0].text for o in _shared_llm.chat(
        [[{"role": "user", "content": p}] for p in prompts], SamplingParams(temperature=0, max_tokens=16))]

    async def run() -> list[str]:
        client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        async with client:
            async def one(p: str) -> str:
                r = await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": p}],
                                                         temperature=0, max_tokens=16)
                return r.choices[0].message.content
            return await asyncio.gather(*(one(p) for p in prompts))

    assert asyncio.run(run()) == expected


def test_async_streaming(server: RunningServer) -> None:
    async def run() -> str:
        client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        async with client:
            stream = await client.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=0,
                                                          max_tokens=12, stream=True)
            return "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])

    assert "Paris" in asyncio.run(run())


def test_models_endpoint(client: openai.OpenAI) -> None:
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    m = models.data[0]
    assert m.owned_by == "ruvllm" and m.created > 0 and m.model_extra["max_model_len"] > 0
