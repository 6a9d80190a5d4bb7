"""Raw HTTP: errors in OpenAI's shape with the right status, disconnects, limits, auth, metrics,
and response bodies validated against OpenAI's published OpenAPI description."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import httpx
import pytest
from jsonschema import Draft202012Validator
from referencing import Registry
from referencing.jsonschema import DRAFT202012

from ruvllm import LLM
from tests.server.conftest import MODEL, RunningServer, start_server

SPEC = Path(__file__).resolve().parents[3] / "shared" / "spec" / "openai-openapi.json"
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8, "temperature": 0}


def _error(r: httpx.Response, status: int, param: str | None = None) -> dict:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"} and {"message", "type", "param", "code"} <= set(body["error"])
    if param is not None:
        assert body["error"]["param"] == param, body
    return body["error"]


@pytest.mark.parametrize("field,value", [
    ("temperature", -1), ("temperature", "hot"), ("top_p", 0), ("n", 0), ("max_tokens", 0),
    ("presence_penalty", 5), ("logit_bias", {"abc": 1}), ("top_logprobs", 50), ("stop", 3),
])
def test_invalid_parameter_is_400_naming_it(http: httpx.Client, field: str, value) -> None:
    err = _error(http.post("/v1/chat/completions", json={**CHAT, field: value}), 400)
    assert field in err["message"] and err["param"].startswith(field)


def test_schema_breaks_are_400(http: httpx.Client) -> None:
    _error(http.post("/v1/chat/completions", json={"model": MODEL}), 400, "messages")
    _error(http.post("/v1/chat/completions", json={**CHAT, "messages": []}), 400, "messages")
    _error(http.post("/v1/chat/completions", json={**CHAT, "messages": [{"role": "wizard", "content": "x"}]}), 400)
    _error(http.post("/v1/completions", json={"model": MODEL, "prompt": [1.5]}), 400)
    _error(http.post("/v1/completions", json={"model": MODEL, "prompt": []}), 400, "prompt")
    r = http.post("/v1/chat/completions", content=b"{not json", headers={"content-type": "application/json"})
    _error(r, 400)
    _error(http.post("/v1/chat/completions", json={**CHAT, "logit_bias": {"99999999": 5}}), 400)
    _error(http.post("/v1/completions", json={"model": MODEL, "prompt": [10**9]}), 400)
    _error(http.post("/v1/chat/completions", json={**CHAT, "tools": [{"type": "function"}]}), 400, "tools[0]")


def test_unknown_model_is_404(http: httpx.Client) -> None:
    err = _error(http.post("/v1/chat/completions", json={**CHAT, "model": "gpt-9"}), 404, "model")
    assert err["code"] == "model_not_found" and "gpt-9" in err["message"]


def test_prompt_longer_than_context_is_400_with_both_numbers(http: httpx.Client, server: RunningServer) -> None:
    limit = server.engine.info.max_seq_len
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": [5] * (limit - 4), "max_tokens": 10})
    err = _error(r, 400)
    assert str(limit) in err["message"] and str(limit + 6) in err["message"]
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": [5] * (limit + 1)})
    assert str(limit) in _error(r, 400)["message"]


def test_unknown_route_and_method(http: httpx.Client) -> None:
    _error(http.get("/v1/nothing"), 404)
    _error(http.get("/v1/chat/completions"), 405)


def test_tokenize_and_detokenize(http: httpx.Client, _shared_llm: LLM) -> None:
    r = http.post("/tokenize", json={"prompt": "Hello world"}).json()
    assert r["tokens"] == _shared_llm.tokenizer.encode("Hello world") and r["count"] == len(r["tokens"])
    assert http.post("/detokenize", json={"tokens": r["tokens"]}).json()["prompt"] == "Hello world"
    chat = http.post("/tokenize", json={"messages": [{"role": "user", "content": "Hi"}]}).json()
    assert chat["count"] > 5
    _error(http.post("/detokenize", json={"tokens": [-1]}), 400, "tokens")
    _error(http.post("/tokenize", json={}), 400)


def test_health(http: httpx.Client) -> None:
    assert http.get("/health").status_code == 200


def test_streaming_client_disconnect_aborts(server: RunningServer) -> None:
    body = {**CHAT, "max_tokens": 2000, "stream": True, "extra": 1, "ignore_eos": True}
    with httpx.Client(base_url=server.url, timeout=60) as c:
        with c.stream("POST", "/v1/chat/completions", json=body) as r:
            lines = r.iter_lines()
            for line in lines:
                if line.startswith("data: ") and '"content": "' in line and '"content": ""' not in line:
                    break
            assert server.engine.stats().running == 1
    stats = server.wait_idle(timeout=10)
    assert stats.running == 0 and stats.free_blocks == stats.total_blocks


def test_non_streaming_client_disconnect_aborts(server: RunningServer) -> None:
    body = {**CHAT, "max_tokens": 2000, "ignore_eos": True}
    with httpx.Client(base_url=server.url, timeout=2.0) as c:
        with pytest.raises(httpx.ReadTimeout):
            c.post("/v1/chat/completions", json=body)
    stats = server.wait_idle(timeout=10)
    assert stats.running == 0 and stats.free_blocks == stats.total_blocks


def test_metrics(http: httpx.Client) -> None:
    http.post("/v1/chat/completions", json=CHAT)
    text = http.get("/metrics").text
    for name in ["ruvllm:num_requests_running", "ruvllm:num_requests_waiting", "ruvllm:kv_cache_usage_perc",
                 "ruvllm:prefix_cache_queries_total", "ruvllm:prefix_cache_hits_total",
                 "ruvllm:num_preemptions_total", "ruvllm:prompt_tokens_total", "ruvllm:generation_tokens_total",
                 "ruvllm:time_to_first_token_seconds_bucket", "ruvllm:inter_token_latency_seconds_bucket",
                 "ruvllm:e2e_request_latency_seconds_count", "ruvllm:request_queue_time_seconds_count"]:
        assert name in text, name
    gen = [ln for ln in text.splitlines() if ln.startswith("ruvllm:generation_tokens_total{")]
    assert gen and float(gen[0].split()[-1]) > 0


# --- schema ------------------------------------------------------------------------------------------
def _nullable_to_json_schema(node):
    """The spec mixes OpenAPI 3.0's `nullable: true` into 3.1 schemas; JSON Schema spells it anyOf null."""
    if isinstance(node, list):
        return [_nullable_to_json_schema(x) for x in node]
    if not isinstance(node, dict):
        return node
    node = {k: _nullable_to_json_schema(v) for k, v in node.items()}
    if node.pop("nullable", False):
        return {"anyOf": [node, {"type": "null"}]}
    return node


@pytest.fixture(scope="module")
def schemas():
    if not SPEC.exists():
        pytest.skip("../shared/spec/openai-openapi.json is not beside the repository")
    spec = _nullable_to_json_schema(json.loads(SPEC.read_text()))
    registry = Registry().with_resource("urn:openai", DRAFT202012.create_resource(spec))

    def validator(name: str) -> Draft202012Validator:
        return Draft202012Validator({"$ref": f"urn:openai#/components/schemas/{name}"}, registry=registry)
    return validator


def test_bodies_validate_against_openai_schema(http: httpx.Client, schemas) -> None:
    chat = http.post("/v1/chat/completions", json={**CHAT, "logprobs": True, "top_logprobs": 2, "n": 2}).json()
    schemas("CreateChatCompletionResponse").validate(chat)
    comp = http.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 4, "logprobs": 2}).json()
    schemas("CreateCompletionResponse").validate(comp)
    schemas("ListModelsResponse").validate(http.get("/v1/models").json())
    with http.stream("POST", "/v1/chat/completions",
                     json={**CHAT, "stream": True, "stream_options": {"include_usage": True}}) as r:
        chunks = [json.loads(ln[6:]) for ln in r.iter_lines() if ln.startswith("data: {")]
    for chunk in chunks:
        schemas("CreateChatCompletionStreamResponse").validate(chunk)


# --- limits (a server of its own) ---------------------------------------------------------
def test_queue_full_is_429(_shared_llm: LLM) -> None:
    for srv in start_server(_shared_llm, max_num_seqs=1, max_queue=0):
        with httpx.Client(base_url=srv.url, timeout=60) as c:
            started = threading.Event()

            def hold() -> None:
                with c.stream("POST", "/v1/chat/completions",
                              json={**CHAT, "max_tokens": 60, "ignore_eos": True, "stream": True}) as r:
                    started.set()
                    for _ in r.iter_lines():
                        pass

            t = threading.Thread(target=hold)
            t.start()
            started.wait(30)
            time.sleep(0.2)
            r = c.post("/v1/chat/completions", json=CHAT)
            assert _error(r, 429)["code"] == "queue_full" and r.headers["retry-after"] == "1"
            t.join()
            assert c.post("/v1/chat/completions", json=CHAT).status_code == 200


def test_connection_stays_open_after_a_500(http: httpx.Client, monkeypatch: pytest.MonkeyPatch) -> None:
    """An unexpected exception is a 500 in OpenAI's shape, and the keep-alive connection serves the
    next request (issue 33, item 21: Starlette re-raised it to uvicorn, which closed the connection)."""
    from ruvllm.server import openai_api

    async def boom(*_: object, **__: object) -> None:
        raise ZeroDivisionError("injected")
    monkeypatch.setattr(openai_api, "_off_loop", boom)
    r = http.post("/tokenize", json={"prompt": "Hi"})
    assert _error(r, 500)["message"] == "internal error: ZeroDivisionError: injected"
    assert r.headers.get("connection") != "close"
    first = r.extensions["network_stream"].get_extra_info("client_addr")
    monkeypatch.undo()
    r = http.post("/tokenize", json={"prompt": "Hi"})
    assert r.status_code == 200 and r.extensions["network_stream"].get_extra_info("client_addr") == first
