"""OpenAI's Responses API (POST /v1/responses, the stored responses) through the official `openai`
SDK on the default model: text, forced function calls as the SDK's typed items, text.format
structured output, the event stream (`responses.stream`), store / retrieve / previous_response_id /
input items / delete, tenants' stores kept apart, and bad input as OpenAI's 400s. Each response the
SDK hands back is validated again by the SDK's own pydantic models (which it builds leniently)."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Literal

import httpx
import openai
import pytest
from openai.types.responses import Response, ResponseFunctionToolCall, ResponseStreamEvent
from pydantic import BaseModel, TypeAdapter

from ruvllm import LLM
from ruvllm.server.response_store import ResponseStore
from ruvllm.server.tenants import read_api_keys
from tests.server.conftest import MODEL, RunningServer, start_server
from tests.server import test_http_errors

WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city.", "strict": True,
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
                          "required": ["city"], "additionalProperties": False}}
FORCED = {"type": "function", "name": "get_weather"}
EVENT = TypeAdapter(ResponseStreamEvent)
openai_schemas = test_http_errors.schemas  # a fixture: OpenAI's published OpenAPI schemas (skips without them)


class Verdict(BaseModel):
    answer: Literal["yes", "no"]


def _client(server: RunningServer, key: str = "x") -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0)


def _strict(resp: Response) -> Response:
    """The SDK builds its objects without validating; validate what came over the wire."""
    return Response.model_validate(resp.to_dict())


def test_create_text_and_usage(server: RunningServer) -> None:
    client = _client(server)
    resp = _strict(client.responses.create(model=MODEL, input="Say hello to the world.", max_output_tokens=6,
                                           temperature=0, metadata={"run": "1"}))
    assert resp.id.startswith("resp_") and resp.object == "response" and resp.model == MODEL
    (msg,) = resp.output
    assert msg.type == "message" and msg.id.startswith("msg_") and msg.role == "assistant"
    assert resp.output_text == msg.content[0].text and resp.output_text
    assert resp.usage.output_tokens <= 6 and resp.usage.total_tokens == resp.usage.input_tokens + resp.usage.output_tokens
    assert resp.metadata == {"run": "1"} and resp.temperature == 0
    if resp.status == "incomplete":  # cut at max_output_tokens, as OpenAI says it
        assert resp.incomplete_details.reason == "max_output_tokens" and resp.usage.output_tokens == 6
    else:
        assert resp.status == "completed" and resp.incomplete_details is None
    # items, instructions and developer messages render; the same input twice hits the prefix cache
    items = [{"role": "developer", "content": "Answer briefly."},
             {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hi!"}]},
             {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Hello."}]},
             {"role": "user", "content": "And again?"}]
    first = client.responses.create(model=MODEL, input=items, instructions="Be kind.", max_output_tokens=3,
                                    temperature=0)
    again = client.responses.create(model=MODEL, input=items, instructions="Be kind.", max_output_tokens=3,
                                    temperature=0)
    assert again.output_text == first.output_text and again.usage.input_tokens_details.cached_tokens > 0


def test_forced_function_call_and_its_output(server: RunningServer) -> None:
    client = _client(server)
    resp = _strict(client.responses.create(model=MODEL, input="What is the weather in Paris?", tools=[WEATHER],
                                           tool_choice=FORCED, max_output_tokens=48, temperature=0))
    assert resp.status == "completed" and resp.output_text == ""
    (call,) = resp.output
    assert isinstance(call, ResponseFunctionToolCall) and call.name == "get_weather"
    assert call.id.startswith("fc_") and call.call_id.startswith("call_")
    assert isinstance(json.loads(call.arguments)["city"], str)
    assert resp.tools[0].name == "get_weather" and resp.tool_choice.name == "get_weather"
    # the result goes back against the stored conversation, and the model answers in text
    answer = client.responses.create(model=MODEL, previous_response_id=resp.id, max_output_tokens=4, temperature=0,
                                     tools=[WEATHER], input=[{"type": "function_call_output", "call_id": call.call_id,
                                                              "output": "sunny, 21 C"}])
    assert answer.previous_response_id == resp.id and answer.output[0].type == "message"
    assert answer.usage.input_tokens > resp.usage.input_tokens + resp.usage.output_tokens
    # or the whole conversation resent by the client, the call item as the SDK gave it
    resent = client.responses.create(model=MODEL, max_output_tokens=4, temperature=0, tools=[WEATHER], store=False,
                                     input=[{"role": "user", "content": "What is the weather in Paris?"},
                                            call.to_dict(), {"type": "function_call_output",
                                                             "call_id": call.call_id, "output": "sunny, 21 C"}])
    assert resent.usage.input_tokens == answer.usage.input_tokens and resent.output_text == answer.output_text


def test_text_format_json_schema(server: RunningServer) -> None:
    client = _client(server)
    parsed = client.responses.parse(model=MODEL, input="Is Paris in France? Answer as JSON.", text_format=Verdict,
                                    max_output_tokens=16, temperature=0)
    assert parsed.status == "completed" and isinstance(parsed.output_parsed, Verdict)
    assert parsed.text.format.type == "json_schema" and parsed.text.format.name == "Verdict"
    obj = client.responses.create(model=MODEL, input="Give a JSON object.", text={"format": {"type": "json_object"}},
                                  max_output_tokens=16, temperature=0)
    assert obj.output_text.lstrip().startswith("{")  # held to JSON from its first token
    if obj.status == "completed":  # and a whole object when it ended on its own
        assert isinstance(json.loads(obj.output_text), dict)


def _events(stream) -> list:
    events = [EVENT.validate_python(e.to_dict()) for e in stream]  # each event, validated by the SDK's union
    assert [e.sequence_number for e in events] == list(range(len(events)))
    return events


def test_stream_text(server: RunningServer) -> None:
    client = _client(server)
    with client.responses.stream(model=MODEL, input="Is Paris in France? Answer as JSON.", text_format=Verdict,
                                 max_output_tokens=16, temperature=0) as stream:
        events = _events(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in events]
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[4:4 + len(deltas)] == ["response.output_text.delta"] * len(deltas) and deltas
    assert kinds[4 + len(deltas):] == ["response.output_text.done", "response.content_part.done",
                                       "response.output_item.done", "response.completed"]
    assert "".join(deltas) == final.output_text and isinstance(final.output_parsed, Verdict)
    assert events[0].response.id == final.id and final.id.startswith("resp_") and final.status == "completed"
    assert events[2].item.id == final.output[0].id and final.usage.output_tokens > 0
    assert _strict(client.responses.retrieve(final.id)).output_text == final.output_text  # stored once it ended


def test_stream_function_call(server: RunningServer) -> None:
    client = _client(server)
    with client.responses.stream(model=MODEL, input="What is the weather in Rome?", tools=[WEATHER],
                                 tool_choice=FORCED, max_output_tokens=48, temperature=0) as stream:
        events = _events(stream)
        final = stream.get_final_response()
    assert [e.type for e in events] == [
        "response.created", "response.in_progress", "response.output_item.added",
        "response.function_call_arguments.delta", "response.function_call_arguments.done",
        "response.output_item.done", "response.completed"]
    (call,) = final.output
    assert call.type == "function_call" and call.id == events[2].item.id and call.name == "get_weather"
    assert events[3].delta == events[4].arguments == call.arguments and json.loads(call.arguments)["city"]


def test_raw_stream_names_each_event_and_ends_incomplete(server: RunningServer) -> None:
    body = {"model": MODEL, "input": "Tell me a long story.", "max_output_tokens": 3, "stream": True}
    with httpx.stream("POST", server.url + "/v1/responses", json=body, timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        frames = [f for f in r.read().decode().split("\n\n") if f]
    pairs = [(f.split("\n")[0], json.loads(f.split("\n")[1].removeprefix("data: "))) for f in frames]
    assert all(line == f"event: {data['type']}" for line, data in pairs)
    last = pairs[-1][1]
    assert last["type"] == "response.incomplete" and last["response"]["status"] == "incomplete"
    assert last["response"]["incomplete_details"] == {"reason": "max_output_tokens"}
    assert last["response"]["output"][0]["status"] == "incomplete"
    Response.model_validate(last["response"])


def test_bodies_and_events_validate_against_openai_schema(server: RunningServer, openai_schemas) -> None:
    """OpenAI's published OpenAPI schemas, beside the SDK's models: the response object, each kind of
    stream event we send, a stored response and its input items."""
    with httpx.Client(base_url=server.url, timeout=60) as http:
        text = http.post("/v1/responses", json={"model": MODEL, "input": "Hi", "max_output_tokens": 3}).json()
        call = http.post("/v1/responses", json={"model": MODEL, "input": "Weather in Oslo?", "tools": [WEATHER],
                                                "tool_choice": "required", "max_output_tokens": 48}).json()
        for body in (text, call):
            openai_schemas("Response").validate(body)
        assert call["output"][0]["type"] == "function_call"
        for req in ({"input": "Hi", "max_output_tokens": 3},
                    {"input": "Weather in Oslo?", "tools": [WEATHER], "tool_choice": FORCED, "max_output_tokens": 48}):
            with http.stream("POST", "/v1/responses", json={"model": MODEL, "stream": True, **req}) as r:
                events = [json.loads(ln[6:]) for ln in r.iter_lines() if ln.startswith("data: ")]
            for event in events:
                openai_schemas("ResponseStreamEvent").validate(event)
        openai_schemas("ResponseItemList").validate(http.get(f"/v1/responses/{text['id']}/input_items").json())
        openai_schemas("Response").validate(http.get(f"/v1/responses/{call['id']}").json())


def test_store_retrieve_chain_input_items_delete(server: RunningServer) -> None:
    client = _client(server)
    first = client.responses.create(model=MODEL, input="My name is Ada.", max_output_tokens=3, temperature=0)
    got = _strict(client.responses.retrieve(first.id))
    assert got.id == first.id and got.output_text == first.output_text and got.usage == first.usage
    second = client.responses.create(model=MODEL, input="What is my name?", previous_response_id=first.id,
                                     max_output_tokens=3, temperature=0)
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    # the second's own input only, newest first
    items = client.responses.input_items.list(second.id)
    assert [i.content[0].text for i in items.data] == ["What is my name?"] and items.data[0].id.startswith("msg_")
    client.responses.delete(first.id)
    for call in (lambda: client.responses.retrieve(first.id), lambda: client.responses.delete(first.id),
                 lambda: client.responses.create(model=MODEL, input="Hi", previous_response_id=first.id,
                                                 max_output_tokens=2)):
        with pytest.raises(openai.NotFoundError):
            call()
    assert client.responses.retrieve(second.id).id == second.id  # holds its own copy of the conversation
    unstored = client.responses.create(model=MODEL, input="Hi", store=False, max_output_tokens=2)
    assert unstored.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


def test_user_tenants_see_only_their_own(server: RunningServer) -> None:
    client = _client(server)
    mine = client.responses.create(model=MODEL, input="Hi", user="alice", max_output_tokens=2)
    assert client.responses.retrieve(mine.id, extra_query={"user": "alice"}).id == mine.id
    for who in ({}, {"user": "bob"}):
        with pytest.raises(openai.NotFoundError) as err:
            client.responses.retrieve(mine.id, extra_query=who)
        assert err.value.body["message"] == f"Response with id '{mine.id}' not found."
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model=MODEL, input="Hi", user="bob", previous_response_id=mine.id, max_output_tokens=2)


@pytest.fixture(scope="module")
def keyed(_shared_llm: LLM, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    keys: Path = tmp_path_factory.mktemp("keys") / "keys"
    keys.write_text("key-a acme\nkey-b globex\n")
    yield from start_server(_shared_llm, api_keys=read_api_keys(keys))


def test_key_tenants_see_only_their_own(keyed: RunningServer) -> None:
    acme, globex = _client(keyed, "key-a"), _client(keyed, "key-b")
    resp = acme.responses.create(model=MODEL, input="A secret.", max_output_tokens=2, user="globex")
    for call in (lambda: globex.responses.retrieve(resp.id), lambda: globex.responses.delete(resp.id),
                 lambda: globex.responses.input_items.list(resp.id),
                 lambda: globex.responses.create(model=MODEL, input="Hi", previous_response_id=resp.id,
                                                 max_output_tokens=2)):
        with pytest.raises(openai.NotFoundError):
            call()
    assert acme.responses.retrieve(resp.id).id == resp.id  # still there: globex's delete was refused


@pytest.mark.parametrize("extra,param", [
    ({"input": [{"type": "message", "role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "input.0.message.content.0.unsupported.type"),
    ({"input": [{"type": "frobnicate"}]}, "input.0"),
    ({"input": [{"role": "wizard", "content": "hi"}]}, "input.0.message.role"),
    ({"input": [{"type": "function_call_output", "call_id": "call_x", "output": "1"}]}, "input.0"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "[1]"}]},
     "input.0.function_call.arguments"),
    ({"input": []}, "input"),
    ({"tools": [{"type": "web_search"}]}, "tools[0]"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "frob"}}}}, "text.format"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format"),
    ({"tools": [WEATHER], "tool_choice": "required",
      "text": {"format": {"type": "json_object"}}}, "tool_choice"),
    ({"max_output_tokens": 10**6}, "max_output_tokens"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"temperature": 3}, "temperature"),
    ({"background": True}, "background"),
    ({"truncation": "auto"}, "truncation"),
    ({"metadata": {"k": "v" * 600}}, "metadata"),
])
def test_bad_input_is_a_400(server: RunningServer, extra: dict, param: str) -> None:
    body = {"model": MODEL, "input": "Hi", "max_output_tokens": 2, **extra}
    with pytest.raises(openai.BadRequestError) as err:
        _client(server).responses.create(**body)
    assert err.value.status_code == 400 and err.value.body["param"] == param, err.value.body
    assert err.value.body["type"] == "invalid_request_error"


def test_unknown_model_and_response_are_404s(server: RunningServer) -> None:
    client = _client(server)
    with pytest.raises(openai.NotFoundError) as err:
        client.responses.create(model="no-such-model", input="Hi", max_output_tokens=2)
    assert err.value.body["code"] == "model_not_found"
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model=MODEL, input="Hi", previous_response_id="resp_nope", max_output_tokens=2)
    metrics = httpx.get(server.url + "/metrics").text
    assert 'endpoint="/v1/responses"' in metrics


def test_store_bounds_count_bytes_and_age() -> None:
    now = [0.0]
    store = ResponseStore(max_count=3, max_bytes=2000, ttl_s=60, clock=lambda: now[0])

    def put(tenant: str, rid: str, pad: int = 0) -> bool:
        return store.put(tenant, {"id": rid, "output": [], "pad": "x" * pad}, [], [])

    for i in range(4):
        assert put("a", f"r{i}")
    assert store.get("a", "r0") is None and store.get("a", "r3") is not None and len(store) == 3  # count
    assert store.get("b", "r3") is None  # another tenant's
    assert put("a", "big", pad=1950) and len(store) == 1 and store.bytes <= 2000  # bytes: older ones went
    assert not put("a", "huge", pad=3000) and store.get("a", "huge") is None  # larger than the whole store
    now[0] = 61.0
    assert store.get("a", "big") is None and len(store) == 0 and store.bytes == 0  # age


def test_engine_failure_in_a_stream_is_response_failed_then_an_error(_shared_llm: LLM) -> None:
    """As OpenAI ends a stream that fails: `response.failed` (status failed, with the error), then an
    `error` event, which the SDK raises. The fault is injected as test_disconnects.py does it, before the
    request, so the stream has begun (created, in_progress) when the engine's first step fails."""
    for srv in start_server(_shared_llm):
        def step() -> list:
            raise RuntimeError("injected fault: the device went away")
        srv.engine._client.core.step = step  # type: ignore[attr-defined]  # no public hook for a fault
        seen = []
        with pytest.raises(openai.APIError) as err:
            with _client(srv).responses.stream(model=MODEL, input="Hi", max_output_tokens=4) as stream:
                seen.extend(stream)
        assert "injected fault" in err.value.message and err.value.body["code"] == "engine_failed"
        assert [e.type for e in seen] == ["response.created", "response.in_progress", "response.failed"]
        failed = Response.model_validate(seen[-1].response.to_dict())
        assert failed.status == "failed" and failed.error.code == "server_error" and failed.usage is None
        deadline = time.monotonic() + 10  # the slots return once the server has sent the last frame
        while srv.sequences_admitted and time.monotonic() < deadline:
            time.sleep(0.02)
        assert srv.sequences_admitted == 0
