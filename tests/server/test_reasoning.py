"""Reasoning output through the official clients, on a tiny random model with Qwen3's own chat
templates (tests/reasoning_fixtures.py): Qwen3-8B's, where the model opens `<think>` itself and
`enable_thinking: false` closes an empty block in the prompt, and Qwen3-4B-Thinking-2507's, which
opens `<think>` in the prompt so the output starts inside the reasoning (only `</think>` can come).
Random weights never write a tag: a grammar forces one where a split must be seen, and on the
opened template everything the model writes is reasoning. Each stream joins to its final answer."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import TYPE_CHECKING

import httpx
import ollama
import openai
import pytest

from ruvllm import LLM
from tests.reasoning_fixtures import QWEN3_TEMPLATE, QWEN3_THINKING_TEMPLATE, thinking_llm, thinking_tokenizer
from tests.server import test_http_errors
from tests.server.conftest import MODEL, RunningServer, start_server

if TYPE_CHECKING:
    import anthropic

openai_schemas = test_http_errors.schemas  # a fixture: OpenAI's published OpenAPI schemas (skips without them)
HI = [{"role": "user", "content": "hi"}]
FORCED = "<think>\nabc\n</think>\n\nanswer"  # what Qwen3 writes, forced by a regex from the first token
END = thinking_tokenizer().convert_tokens_to_ids("</think>")
GREEDY = {"temperature": 0}  # the anthropic SDK no longer takes temperature as an argument; the API does


@pytest.fixture(scope="module")
def llm(tmp_path_factory: pytest.TempPathFactory) -> LLM:
    return thinking_llm(tmp_path_factory.mktemp("models") / "tiny-qwen3")


@pytest.fixture(scope="module")
def qwen3(llm: LLM) -> Iterator[RunningServer]:
    yield from start_server(llm, chat_template=QWEN3_TEMPLATE)


@pytest.fixture(scope="module")
def opened(llm: LLM) -> Iterator[RunningServer]:
    yield from start_server(llm, chat_template=QWEN3_THINKING_TEMPLATE)


def _openai(srv: RunningServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0)


def _claude(srv: RunningServer) -> anthropic.Anthropic:
    # Imported here, not at the top: importing the SDK costs ~2.4 s of CPU, and every pytest worker
    # imports every test module to collect it.
    import anthropic

    return anthropic.Anthropic(base_url=srv.url, api_key="x", max_retries=0)


def _chat_stream(srv: RunningServer, **kw) -> tuple[str, str]:
    reasoning, content = [], []
    for chunk in _openai(srv).chat.completions.create(model=MODEL, messages=HI, stream=True, **kw):
        for choice in chunk.choices:
            extra = choice.delta.model_extra or {}
            assert extra.get("reasoning_content") == extra.get("reasoning")
            reasoning.append(extra.get("reasoning_content") or "")
            content.append(choice.delta.content or "")
    return "".join(reasoning), "".join(content)


def test_chat_splits_reasoning_from_content(qwen3: RunningServer) -> None:
    """A thinking model's `<think>` block is message.reasoning_content (and .reasoning); the rest is
    the content. Streamed, the reasoning comes as its own deltas; the tag tokens never show."""
    kw = {"max_tokens": 40, "temperature": 0, "extra_body": {"guided_regex": FORCED}}
    msg = _openai(qwen3).chat.completions.create(model=MODEL, messages=HI, **kw).choices[0].message
    assert (msg.model_extra["reasoning_content"], msg.model_extra["reasoning"], msg.content) == ("abc", "abc", "answer")
    assert _chat_stream(qwen3, **kw) == ("abc", "answer")


def test_thinking_switches_reach_the_template(qwen3: RunningServer) -> None:
    """enable_thinking (chat_template_kwargs), reasoning_effort none, Anthropic's thinking disabled and
    Ollama's think false each make Qwen3's template close an empty reasoning block in the prompt."""
    closed = len(thinking_tokenizer().encode("<think>\n\n</think>\n\n", add_special_tokens=False))
    client = _openai(qwen3)

    def prompt_tokens(**kw) -> int:
        return client.chat.completions.create(model=MODEL, messages=HI, max_tokens=1, **kw).usage.prompt_tokens

    base = prompt_tokens()
    assert prompt_tokens(extra_body={"chat_template_kwargs": {"enable_thinking": False}}) == base + closed
    assert prompt_tokens(extra_body={"chat_template_kwargs": {"enable_thinking": True}}) == base
    assert prompt_tokens(reasoning_effort="none") == base + closed
    claude = _claude(qwen3)
    count = claude.messages.count_tokens(model=MODEL, messages=HI).input_tokens
    assert claude.messages.count_tokens(model=MODEL, messages=HI,
                                        thinking={"type": "disabled"}).input_tokens == count + closed
    assert claude.messages.count_tokens(model=MODEL, messages=HI, thinking={"type": "enabled", "budget_tokens": 1024}
                                        ).input_tokens == count
    olla = ollama.Client(host=qwen3.url, timeout=60)
    evals = [olla.chat(model=MODEL, messages=HI, think=think, options={"num_predict": 1}).prompt_eval_count
             for think in (None, False, True)]
    assert evals == [base, base + closed, base]
    with httpx.Client(base_url=qwen3.url) as http:
        bad = http.post("/v1/chat/completions", json={"model": MODEL, "messages": HI, "max_tokens": 1,
                                                      "chat_template_kwargs": {"enable_thinking": "no"}})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "chat_template_kwargs.enable_thinking"
        assert "thinking" in http.post("/api/show", json={"model": MODEL}).json()["capabilities"]


def test_output_inside_opened_reasoning_is_reasoning_everywhere(opened: RunningServer, openai_schemas) -> None:
    """With the reasoning opened by the prompt and no `</think>` written, all the output is reasoning:
    reasoning_content (chat), a reasoning item (Responses), a thinking block (Anthropic), thinking
    (Ollama); the content is empty, and each stream joins to the same text."""
    kw = {"max_tokens": 8, "temperature": 0}
    msg = _openai(opened).chat.completions.create(model=MODEL, messages=HI, **kw).choices[0].message
    thought = msg.model_extra["reasoning_content"]
    assert thought and msg.content == ""
    assert _chat_stream(opened, **kw) == (thought, "")

    client = _openai(opened)
    resp = client.responses.create(model=MODEL, input="hi", max_output_tokens=8, temperature=0)
    assert [item.type for item in resp.output] == ["reasoning"] and resp.output[0].content[0].text == thought
    assert resp.output[0].id.startswith("rs_") and resp.output_text == ""
    with client.responses.stream(model=MODEL, input="hi", max_output_tokens=8, temperature=0) as stream:
        events = list(stream)  # cut at max_output_tokens: it ends with response.incomplete, not completed
    deltas = [e.delta for e in events if e.type == "response.reasoning_text.delta"]
    final = events[-1].response
    assert events[-1].type == "response.incomplete" and final.output[0].status == "incomplete"
    assert "".join(deltas) == thought and final.output[0].content[0].text == thought
    with httpx.Client(base_url=opened.url, timeout=60) as http:
        body = {"model": MODEL, "input": "hi", "max_output_tokens": 8, "temperature": 0}
        openai_schemas("Response").validate(http.post("/v1/responses", json=body).json())
        with http.stream("POST", "/v1/responses", json={**body, "stream": True}) as r:
            events = [json.loads(ln[6:]) for ln in r.iter_lines() if ln.startswith("data: ")]
    assert [e["type"] for e in events][2:5] == ["response.output_item.added", "response.content_part.added",
                                                "response.reasoning_text.delta"]
    for event in events:
        openai_schemas("ResponseStreamEvent").validate(event)

    claude = _claude(opened)
    message = claude.messages.create(model=MODEL, messages=HI, max_tokens=8, extra_body=GREEDY)
    assert [b.type for b in message.content] == ["thinking"] and message.content[0].thinking == thought
    with claude.messages.stream(model=MODEL, messages=HI, max_tokens=8, extra_body=GREEDY) as stream:
        streamed = stream.get_final_message()
    assert [b.type for b in streamed.content] == ["thinking"] and streamed.content[0].thinking == thought

    olla = ollama.Client(host=opened.url, timeout=60)
    options = {"num_predict": 8, "temperature": 0}
    reply = olla.chat(model=MODEL, messages=HI, think=True, options=options)
    assert reply.message.thinking == thought and reply.message.content == ""
    parts = list(olla.chat(model=MODEL, messages=HI, think=True, options=options, stream=True))
    assert "".join(p.message.thinking or "" for p in parts) == thought
    assert olla.generate(model=MODEL, prompt="hi", think=True, options=options).thinking == thought


def test_prefill_that_opens_reasoning(qwen3: RunningServer) -> None:
    """On Qwen3-8B's template the model opens its own reasoning; a prefill may open it for it (Anthropic
    and Ollama continue a last assistant message): the continuation is reasoning."""
    msgs = [*HI, {"role": "assistant", "content": "<think>\n"}]
    claude = _claude(qwen3)
    message = claude.messages.create(model=MODEL, messages=msgs, max_tokens=6, extra_body=GREEDY)
    assert [b.type for b in message.content] == ["thinking"] and message.content[0].signature == ""
    reply = ollama.Client(host=qwen3.url, timeout=60).chat(model=MODEL, messages=msgs, think=True,
                                                           options={"num_predict": 6, "temperature": 0})
    assert reply.message.thinking == message.content[0].thinking and reply.message.content == ""


def test_constraint_starts_after_the_reasoning(opened: RunningServer) -> None:
    """Inside the reasoning the output is free; the constraint holds from `</think>` on. Here the
    end tag is pushed with a logit bias: the reasoning ends at once and the answer is the choice."""
    kw = {"max_tokens": 12, "temperature": 0}
    msg = _openai(opened).chat.completions.create(
        model=MODEL, messages=HI, logit_bias={str(END): 100}, extra_body={"guided_choice": ["yes", "no"]},
        **kw).choices[0].message
    assert msg.model_extra["reasoning_content"] == "" and msg.content in ("yes", "no")
    # without the end tag the whole output is reasoning, which no JSON schema held
    claude = _claude(opened)
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    message = claude.messages.create(model=MODEL, messages=HI, max_tokens=8,
                                     extra_body={**GREEDY, "output_config": {"format": {"type": "json_schema",
                                                                                         "schema": schema}}})
    plain = claude.messages.create(model=MODEL, messages=HI, max_tokens=8, extra_body=GREEDY)
    assert [b.type for b in message.content] == ["thinking"]
    assert message.content[0].thinking == plain.content[0].thinking


def test_a_model_that_does_not_think_is_as_before(_tiny_llm: LLM) -> None:
    """No reasoning fields, and Ollama's think still refused, where the template knows no <think>
    (the default model's case)."""
    for srv in start_server(_tiny_llm):
        msg = _openai(srv).chat.completions.create(model=MODEL, messages=HI, max_tokens=3).choices[0].message
        assert "reasoning_content" not in (msg.model_extra or {}) and "reasoning" not in (msg.model_extra or {})
        with pytest.raises(ollama.ResponseError, match="does not support thinking"):
            ollama.Client(host=srv.url, timeout=60).chat(model=MODEL, messages=HI, think=True)
        with httpx.Client(base_url=srv.url) as http:
            assert "thinking" not in http.post("/api/show", json={"model": MODEL}).json()["capabilities"]
