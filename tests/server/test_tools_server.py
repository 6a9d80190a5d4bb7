"""Tool calling through the real `openai` client (the default model, whose template knows no tools:
the documented system-prompt format and the hermes parser): `required` and a named function give
calls whose arguments validate against the tool's schema, streamed and not; `auto` reads a call out
of the model's text (forced here by a grammar, so the test does not depend on a 135M model's
judgement); tool results go back through the conversation; malformed tools are 400s by name."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import jsonschema
import openai
import pytest

from ruvllm import LLM
from tests.server.conftest import MODEL, RunningServer, start_server

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                      "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                     "required": ["city"]}}},
    {"type": "function", "function": {"name": "add", "description": "Add two integers.",
                                      "parameters": {"type": "object",
                                                     "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                                                     "required": ["a", "b"]}}},
]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def server(_default_llm: LLM) -> Iterator[RunningServer]:
    """The model as a user gets it (packed 4-bit weights): what these tests check is the API's, not
    the fp32 reference's arithmetic, and a decode step costs 10 ms of CPU here rather than 35."""
    yield from start_server(_default_llm)


def _client(server: RunningServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)


def _check_calls(calls) -> list[str]:
    assert calls
    for call in calls:
        assert call.type == "function" and call.id.startswith("call")
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    return [c.function.name for c in calls]


def test_required_and_named_calls_validate(server: RunningServer) -> None:
    client = _client(server)
    out = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required",
                                         max_tokens=80, temperature=0)
    assert out.choices[0].finish_reason == "tool_calls" and out.choices[0].message.content is None
    _check_calls(out.choices[0].message.tool_calls)
    named = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "2 plus 3?"}],
                                           tools=TOOLS, tool_choice={"type": "function", "function": {"name": "add"}},
                                           max_tokens=60, temperature=0.7, seed=3)
    assert _check_calls(named.choices[0].message.tool_calls) == ["add"]

    stream = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required",
                                            max_tokens=80, temperature=0, stream=True)
    calls: dict[int, dict] = {}
    reasons = []
    for chunk in stream:
        for choice in chunk.choices:
            reasons.append(choice.finish_reason)
            for d in choice.delta.tool_calls or []:
                entry = calls.setdefault(d.index, {"name": "", "arguments": "", "id": None})
                entry["id"] = entry["id"] or d.id
                entry["name"] += d.function.name or ""
                entry["arguments"] += d.function.arguments or ""
    assert reasons[-1] == "tool_calls" and calls
    assert [c["name"] for c in calls.values()] == [c.function.name for c in out.choices[0].message.tool_calls]
    for c in calls.values():
        jsonschema.validate(json.loads(c["arguments"]), SCHEMAS[c["name"]])


def test_auto_reads_a_call_out_of_the_text(server: RunningServer) -> None:
    """The hermes block the default model's system prompt asks for, forced by a grammar: parsed into
    tool_calls, plain and streamed; with tool_choice none the same text stays content."""
    forced = 'root ::= "<tool_call>\\n{\\"name\\": \\"get_weather\\", \\"arguments\\": {\\"city\\": \\"Paris\\"}}\\n</tool_call>"'
    client = _client(server)
    args = dict(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=60, temperature=0,
                extra_body={"guided_grammar": forced})
    out = client.chat.completions.create(**args)
    (call,) = out.choices[0].message.tool_calls
    assert out.choices[0].finish_reason == "tool_calls"
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}
    chunks = list(client.chat.completions.create(**args, stream=True))
    deltas = [d for c in chunks for ch in c.choices for d in (ch.delta.tool_calls or [])]
    assert [d.function.name for d in deltas] == ["get_weather"]
    assert not "".join(ch.delta.content or "" for c in chunks for ch in c.choices)  # the block is not content
    none = client.chat.completions.create(**{**args, "tool_choice": "none"})
    assert none.choices[0].message.tool_calls is None and "<tool_call>" in none.choices[0].message.content
    # text after the call is content, streamed or not
    after = {**args, "extra_body": {"guided_grammar": forced[:-1] + ' Done."'}}
    out = client.chat.completions.create(**after)
    assert out.choices[0].message.content == "Done." and len(out.choices[0].message.tool_calls) == 1
    chunks = list(client.chat.completions.create(**after, stream=True))
    assert "".join(ch.delta.content or "" for c in chunks for ch in c.choices).strip() == "Done."


def test_tool_results_go_back_through_the_conversation(server: RunningServer) -> None:
    client = _client(server)
    messages = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature_c": 21, "sky": "clear"}'},
    ]
    out = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, max_tokens=1, temperature=0)
    before = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=1, temperature=0)
    # the call (its arguments) and the result (its content) are in the prompt: more than a dozen tokens more
    assert out.usage.prompt_tokens >= before.usage.prompt_tokens + 20
    bad = httpx.post(server.url + "/v1/chat/completions", timeout=30, json={
        "model": MODEL, "max_tokens": 1, "tools": TOOLS, "messages": ASK + [{"role": "assistant", "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "add", "arguments": "{not json"}}]}]})
    assert bad.status_code == 400 and "arguments is not JSON" in bad.json()["error"]["message"]


def test_malformed_tools_are_400_by_name(server: RunningServer) -> None:
    cases = [({"tools": [{"type": "function", "function": {}}]}, "tools[0]"),
             ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
             ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
             ({"tool_choice": "required"}, "tool_choice"),
             ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
             ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "frobnicate"}}}],
               "tool_choice": "required"}, "tools")]
    for extra, param in cases:
        r = httpx.post(server.url + "/v1/chat/completions", timeout=30,
                       json={"model": MODEL, "messages": ASK, "max_tokens": 5, **extra})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (extra, r.text)
