"""Anthropic's Messages API through the official `anthropic` SDK (whose typed models parse every body
and event) and LangChain's ChatAnthropic, against the default model: text, streams, tool use both
ways, structured output, count_tokens, stop reasons, the tenant of metadata.user_id, x-api-key, and
bad input as Anthropic's typed errors."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

import httpx
import openai
import pytest
from pydantic import BaseModel

from ruvllm import LLM
from tests.server.conftest import MODEL, RunningServer, start_server

# The SDK is imported where a test uses it, not here: importing it costs ~2.4 s of CPU (3.6 s before
# its bytecode is written), and every pytest worker imports every test module to collect it.
if TYPE_CHECKING:
    import anthropic

ASK = [{"role": "user", "content": "Name three colors."}]
GREEDY = {"temperature": 0}  # not a parameter of this SDK's create(): sent as Anthropic's body field
WEATHER = {"name": "get_weather", "description": "The weather in a city.",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
                            "required": ["city"]}}


def client(server: RunningServer, key: str = "x") -> anthropic.Anthropic:
    import anthropic

    return anthropic.Anthropic(base_url=server.url, api_key=key, max_retries=0)


def _text(message: anthropic.types.Message) -> str:
    from anthropic.types import TextBlock

    return "".join(b.text for b in message.content if isinstance(b, TextBlock))


def test_create_answers_as_chat_completions_does(server: RunningServer) -> None:
    """The same conversation through both dialects is the same prompt and the same greedy reply."""
    from anthropic.types import TextBlock

    system = "You are a helpful assistant."
    msg = client(server).messages.create(model=MODEL, max_tokens=8, system=system, messages=ASK, extra_body=GREEDY)
    assert msg.type == "message" and msg.role == "assistant" and msg.model == MODEL
    assert msg.id.startswith("msg_") and len(msg.id) == 4 + 32
    assert [type(b) for b in msg.content] == [TextBlock] and msg.content[0].text
    assert msg.stop_reason in ("end_turn", "max_tokens") and msg.stop_sequence is None
    assert 0 < msg.usage.output_tokens <= 8
    chat = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0).chat.completions.create(
        model=MODEL, max_tokens=8, temperature=0, messages=[{"role": "system", "content": system}, *ASK])
    assert msg.content[0].text == chat.choices[0].message.content
    assert msg.usage.input_tokens + msg.usage.cache_read_input_tokens == chat.usage.prompt_tokens
    assert msg.usage.output_tokens == chat.usage.completion_tokens
    # system as text blocks (with a cache_control the server ignores) is the same prompt
    blocks = [{"type": "text", "text": system, "cache_control": {"type": "ephemeral"}}]
    again = client(server).messages.create(model=MODEL, max_tokens=8, system=blocks, messages=ASK, extra_body=GREEDY)
    assert _text(again) == _text(msg)
    metrics = httpx.get(server.url + "/metrics").text
    assert 'endpoint="/v1/messages"' in metrics


def test_stream_events_and_final_message(server: RunningServer) -> None:
    c = client(server)
    created = c.messages.create(model=MODEL, max_tokens=8, messages=ASK, extra_body=GREEDY)
    with c.messages.stream(model=MODEL, max_tokens=8, messages=ASK, extra_body=GREEDY) as stream:
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert streamed == _text(final) == _text(created)
    assert final.stop_reason == created.stop_reason and final.usage.output_tokens == created.usage.output_tokens
    assert final.id.startswith("msg_")
    events = [e.type for e in c.messages.create(model=MODEL, max_tokens=8, messages=ASK, stream=True,
                                                extra_body=GREEDY)]
    assert events[:2] == ["message_start", "content_block_start"] and events[-2:] == ["message_delta", "message_stop"]
    assert events[-3] == "content_block_stop" and set(events[2:-3]) == {"content_block_delta"}
    # the SDK drops pings before its parser sees them: on the wire, each frame's event names its type
    body = {"model": MODEL, "max_tokens": 2, "messages": ASK, "stream": True}
    with httpx.stream("POST", server.url + "/v1/messages", json=body, timeout=60) as r:
        frames = [f for f in r.read().decode().split("\n\n") if f]
    named = [(f.split("\n")[0], json.loads(f.split("\n")[1].removeprefix("data: "))["type"]) for f in frames]
    assert all(line == f"event: {kind}" for line, kind in named)
    assert [kind for _, kind in named][:2] == ["message_start", "ping"]


def test_stop_sequences_and_max_tokens(server: RunningServer) -> None:
    c = client(server)
    full = _text(c.messages.create(model=MODEL, max_tokens=8, messages=ASK, extra_body=GREEDY))
    word = full.split()[1]  # a word the greedy reply is sure to reach
    cut = c.messages.create(model=MODEL, max_tokens=8, messages=ASK, stop_sequences=[word, "zzqx"], extra_body=GREEDY)
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == word
    assert _text(cut) == full[:full.index(word)]
    with c.messages.stream(model=MODEL, max_tokens=8, messages=ASK, stop_sequences=[word],
                           extra_body=GREEDY) as stream:
        final = stream.get_final_message()
    assert (final.stop_reason, final.stop_sequence, _text(final)) == ("stop_sequence", word, _text(cut))
    short = c.messages.create(model=MODEL, max_tokens=2, messages=ASK, extra_body=GREEDY)
    assert short.stop_reason == "max_tokens" and short.usage.output_tokens == 2


@pytest.mark.parametrize("choice", [{"type": "tool", "name": "get_weather"},
                                    {"type": "any", "disable_parallel_tool_use": True}])
def test_forced_tool_call_is_a_typed_block_and_round_trips(server: RunningServer, choice: dict) -> None:
    from anthropic.types import ToolUseBlock

    c = client(server)
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    msg = c.messages.create(model=MODEL, max_tokens=40, messages=ask, tools=[WEATHER], tool_choice=choice,
                            extra_body=GREEDY)
    assert msg.stop_reason == "tool_use"
    (call,) = msg.content
    assert isinstance(call, ToolUseBlock) and call.name == "get_weather" and call.id.startswith("toolu_")
    assert isinstance(call.input, dict) and isinstance(call.input["city"], str)
    if choice["type"] == "any":
        return  # the same grammar as the named tool's (one tool, one call): the rest is the same
    with c.messages.stream(model=MODEL, max_tokens=40, messages=ask, tools=[WEATHER], tool_choice=choice,
                           extra_body=GREEDY) as stream:
        final = stream.get_final_message()
    assert final.stop_reason == "tool_use" and [(b.type, b.name, b.input) for b in final.content] == \
        [("tool_use", "get_weather", call.input)]
    # the call and its result sent back: the next turn reads them (tool_use -> tool_calls, tool_result -> tool)
    turn = [*ask, {"role": "assistant", "content": [call.model_dump(exclude_none=True)]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                          "content": [{"type": "text", "text": "Sunny, 24 C"}]}]}]
    reply = c.messages.create(model=MODEL, max_tokens=4, messages=turn, tools=[WEATHER], extra_body=GREEDY)
    assert reply.stop_reason in ("end_turn", "max_tokens", "tool_use")
    counted = c.messages.count_tokens(model=MODEL, messages=turn, tools=[WEATHER]).input_tokens
    assert counted == reply.usage.input_tokens + reply.usage.cache_read_input_tokens
    assert counted > c.messages.count_tokens(model=MODEL, messages=turn[:1], tools=[WEATHER]).input_tokens


class Verdict(BaseModel):
    answer: bool


def test_structured_output_through_output_config(server: RunningServer) -> None:
    c = client(server)
    ask = [{"role": "user", "content": "Is the sky blue? Answer in JSON."}]
    parsed = c.messages.parse(model=MODEL, max_tokens=16, messages=ask, output_format=Verdict, extra_body=GREEDY)
    assert isinstance(parsed.parsed_output, Verdict)
    schema = {"type": "object", "properties": {"color": {"enum": ["red", "blue"]}}, "required": ["color"],
              "additionalProperties": False}
    msg = c.messages.create(model=MODEL, max_tokens=16, messages=ask, extra_body=GREEDY,
                            output_config={"format": {"type": "json_schema", "schema": schema}})
    assert json.loads(_text(msg))["color"] in ("red", "blue") and msg.stop_reason == "end_turn"


def test_count_tokens_is_the_prompt(server: RunningServer) -> None:
    c = client(server)
    counted = c.messages.count_tokens(model=MODEL, messages=ASK, system="Be brief.").input_tokens
    msg = c.messages.create(model=MODEL, max_tokens=1, messages=ASK, system="Be brief.")
    assert counted == msg.usage.input_tokens + msg.usage.cache_read_input_tokens > 0


def test_prefill_is_continued(server: RunningServer) -> None:
    """A last assistant message is the start of the reply: what comes back continues it."""
    c = client(server)
    full = _text(c.messages.create(model=MODEL, max_tokens=8, messages=ASK, extra_body=GREEDY))
    head = full.split(" ")[0]
    rest = c.messages.create(model=MODEL, max_tokens=6, messages=[*ASK, {"role": "assistant", "content": head}],
                             extra_body=GREEDY)
    assert rest.usage.output_tokens > 0 and full.startswith(head + _text(rest)), (full, head, _text(rest))


def test_metadata_user_id_names_the_tenant(server: RunningServer) -> None:
    """Each tenant but the default has a prefix cache of its own (tests/server/test_tenants.py for chat
    completions): cache_read_input_tokens shows it."""
    c = client(server)
    system = "You answer questions about the weather, politely and briefly, in one short sentence at most."

    def cached(user: str) -> int:
        msg = c.messages.create(model=MODEL, max_tokens=1, system=system, messages=ASK, metadata={"user_id": user})
        return msg.usage.cache_read_input_tokens

    assert cached("anthropic-alice") == 0
    assert cached("anthropic-alice") > 0
    assert cached("anthropic-bob") == 0


def _error(exc: anthropic.APIStatusError, kind: str) -> str:
    assert exc.body["type"] == "error" and exc.body["error"]["type"] == kind, exc.body
    return exc.body["error"]["message"]


def test_bad_input_is_anthropics_typed_error(server: RunningServer) -> None:
    import anthropic

    c = client(server)
    with pytest.raises(anthropic.NotFoundError) as e:
        c.messages.create(model="claude-nope", max_tokens=4, messages=ASK)
    assert "claude-nope" in _error(e.value, "not_found_error")
    with pytest.raises(anthropic.NotFoundError):
        c.messages.count_tokens(model="claude-nope", messages=ASK)
    bad = [
        ({"messages": [{"role": "system", "content": "hi"}]}, "messages.0.role"),
        ({"messages": ASK, "extra_body": {"temperature": 1.5}}, "temperature"),
        ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "image"),
        ({"messages": ASK, "tools": [WEATHER], "tool_choice": {"type": "tool", "name": "nope"}}, "tool_choice"),
        ({"messages": ASK, "tools": [{"name": "x"}]}, "input_schema"),
        ({"messages": [*ASK, {"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "x",
                                                                 "input": {}}]}]}, "tool_result"),
    ]
    for extra, named in bad:
        with pytest.raises(anthropic.BadRequestError) as e:
            c.messages.create(model=MODEL, max_tokens=4, **extra)
        assert named in _error(e.value, "invalid_request_error"), extra
    with pytest.raises(anthropic.BadRequestError) as e:  # no room left for a reply: tokenized, never run
        c.messages.create(model=MODEL, max_tokens=4, messages=[{"role": "user", "content": "word " * 9000}])
    assert "maximum context length" in _error(e.value, "invalid_request_error")
    r = httpx.post(server.url + "/v1/messages", json={"model": MODEL, "messages": ASK})  # no max_tokens
    assert r.status_code == 400 and r.json()["type"] == "error" and "max_tokens" in r.json()["error"]["message"]
    # what the server does not know is ignored: new fields, the beta query, anthropic-beta headers
    msg = c.beta.messages.create(model=MODEL, max_tokens=2, messages=ASK, betas=["some-beta-2099-01-01"],
                                 extra_body={"a_future_field": {"x": 1}, "thinking": {"type": "disabled"}})
    assert msg.usage.output_tokens == 2


def test_x_api_key(_shared_llm: LLM) -> None:
    import anthropic

    for running in start_server(_shared_llm, api_key="sesame"):
        with pytest.raises(anthropic.AuthenticationError) as e:
            client(running, "wrong").messages.create(model=MODEL, max_tokens=2, messages=ASK)
        _error(e.value, "authentication_error")
        assert client(running, "sesame").messages.create(model=MODEL, max_tokens=2, messages=ASK).usage.output_tokens


def test_langchain_chat_anthropic(server: RunningServer) -> None:
    from langchain_anthropic import ChatAnthropic

    llm = ChatAnthropic(model=MODEL, base_url=server.url, api_key="x", max_retries=0, temperature=0, max_tokens=8)
    reply = llm.invoke("Name three colors.")
    assert isinstance(reply.content, str) and reply.content
    assert reply.usage_metadata["output_tokens"] > 0
    chunks = list(llm.stream("Name three colors."))
    assert "".join(c.text for c in chunks) == reply.content
    usage = sum((c for c in chunks[1:]), chunks[0]).usage_metadata  # the second time, from the prefix cache
    assert [usage[k] for k in ("input_tokens", "output_tokens")] == \
        [reply.usage_metadata[k] for k in ("input_tokens", "output_tokens")]
    assert usage["input_token_details"]["cache_read"] > 0

    def get_weather(city: str) -> str:
        """The weather in a city."""
        return "sunny"

    llm = ChatAnthropic(model=MODEL, base_url=server.url, api_key="x", max_retries=0, temperature=0, max_tokens=40)
    msg = llm.bind_tools([get_weather], tool_choice="get_weather").invoke("What is the weather in Paris?")
    assert [c["name"] for c in msg.tool_calls] == ["get_weather"] and isinstance(msg.tool_calls[0]["args"]["city"], str)


def test_stop_reasons() -> None:
    """How a completion's end reads as Anthropic's stop_reason: max_tokens is a ceiling, and a reply the
    context window cut before it (which needs a prompt of the whole window to run) is its own reason."""
    from ruvllm.outputs import CompletionOutput
    from ruvllm.request import FinishReason
    from ruvllm.server.anthropic_output import _stop

    def out(reason: FinishReason, n: int, stop: str | int | None = None) -> CompletionOutput:
        return CompletionOutput(0, "x", list(range(n)), reason, stop)

    assert _stop(out(FinishReason.LENGTH, 8), False, 8) == ("max_tokens", None)
    assert _stop(out(FinishReason.LENGTH, 5), False, 8) == ("model_context_window_exceeded", None)
    assert _stop(out(FinishReason.STOP, 3, "END"), False, 8) == ("stop_sequence", "END")
    assert _stop(out(FinishReason.STOP, 3, 2), False, 8) == ("end_turn", None)  # EOS, a stop token
    assert _stop(out(FinishReason.STOP, 3), True, 8) == ("tool_use", None)
