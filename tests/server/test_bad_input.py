"""Bad input from an adversarial client (issue 12's table): every case is a 4xx in OpenAI's error shape
naming the field at fault, and none reaches the engine's step, so requests beside it are untouched."""

from __future__ import annotations

import asyncio
import json
import threading

import httpx
import pytest

from ruvllm import LLM
from tests.server.conftest import MODEL, RunningServer, start_server
from tests.server.raw_http import exchange, request_bytes

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "temperature": 0}
COMP = {"model": MODEL, "prompt": "Hi", "max_tokens": 4, "temperature": 0}
HUGE = 10**20

# (route, body, status, param). Raw JSON text where Python's json cannot write it (1e999, a lone
# surrogate escape, NaN).
CASES = [
    ("/v1/completions", {**COMP, "top_k": HUGE}, 400, "top_k"),
    ("/v1/chat/completions", {**CHAT, "top_k": HUGE}, 400, "top_k"),
    ("/v1/completions", {**COMP, "top_k": 50_000}, 400, "top_k"),  # past the 49,152-token vocabulary
    ("/v1/completions", {**COMP, "seed": 2**70}, 400, "seed"),
    ("/v1/completions", {**COMP, "seed": -(2**63) - 1}, 400, "seed"),
    ("/v1/completions", {**COMP, "seed": 2**64 - 1, "n": 2}, 200, None),  # the children's seeds wrap
    ("/v1/completions", '{"model": "%s", "prompt": "a\\udfffb", "max_tokens": 2}' % MODEL, 400, "prompt"),
    ("/tokenize", '{"prompt": "a\\udfffb"}', 400, "prompt"),
    ("/v1/completions", '{"model": "x\\udfff", "prompt": "a"}', 400, "model"),
    ("/v1/chat/completions", '{"model": "%s", "messages": [{"role": "user", "content": "\\ud800"}]}' % MODEL,
     400, "messages.0.content"),
    ("/v1/completions", {**COMP, "logit_bias": {"99999999": 5}}, 400, "logit_bias"),
    ("/v1/completions", {**COMP, "stop_token_ids": [10**9]}, 400, "stop_token_ids"),
    ("/v1/completions", {**COMP, "stop_token_ids": [-1]}, 400, "stop_token_ids"),
    ("/v1/completions", '{"model": "%s", "prompt": "a", "repetition_penalty": 1e999}' % MODEL, 400,
     "repetition_penalty"),
    ("/v1/completions", '{"model": "%s", "prompt": "a", "temperature": NaN}' % MODEL, 400, "temperature"),
    ("/v1/completions", {**COMP, "max_tokens": HUGE}, 400, "max_tokens"),
    ("/v1/completions", {**COMP, "n": 129}, 400, "n"),
    ("/v1/completions", {**COMP, "logprobs": HUGE}, 400, "logprobs"),
    ("/v1/chat/completions", {**CHAT, "logprobs": True, "top_logprobs": HUGE}, 400, "top_logprobs"),
    ("/v1/completions", {**COMP, "priority": "urgent"}, 400, "priority"),
    ("/v1/completions", {**COMP, "min_p": 2}, 400, "min_p"),
    ("/v1/completions", "[" * 100_000 + "]" * 100_000, 400, None),
    ("/detokenize", {"tokens": [HUGE]}, 400, "tokens"),
    ("/v1/completions", {**COMP, "user": "u" * 4_000_000}, 400, "user"),  # 40 of these grew the witness log 160 MB
    ("/v1/chat/completions", {**CHAT, "user": "u" * 257}, 400, "user"),
    # a format without its `type` (found by benchmarks/fuzz_routes.py): it was served unconstrained
    ("/v1/chat/completions", {**CHAT, "response_format": {}}, 400, "response_format"),
    ("/v1/completions", {**COMP, "response_format": {"json_schema": {"schema": {"type": "object"}}}}, 400,
     "response_format"),
]


def _check(status: int, headers: dict[str, str], body: bytes, want: int, param: str | None) -> dict:
    assert status == want, body[:500]
    data = json.loads(body)
    if want >= 400:
        assert set(data) == {"error"} and {"message", "type", "param", "code"} <= set(data["error"]), data
        if param is not None:
            assert data["error"]["param"] == param, data
        return data["error"]
    return data


@pytest.mark.parametrize("path,body,status,param", CASES, ids=[f"{i}-{c[0]}" for i, c in enumerate(CASES)])
def test_bad_input_is_4xx_naming_the_field(server: RunningServer, path, body, status, param) -> None:
    raw = body.encode() if isinstance(body, str) else json.dumps(body).encode()
    got = asyncio.run(exchange(server.url, request_bytes("POST", path, raw)))
    _check(*got, status, param)
    assert server.engine.is_alive


STREAMED = [c for c in CASES if c[1] is not None and isinstance(c[1], dict) and c[2] == 400
            and c[3] in ("prompt", "logit_bias", "stop_token_ids", "top_k")]


@pytest.mark.parametrize("path,body,status,param", STREAMED, ids=[f"{c[3]}-{i}" for i, c in enumerate(STREAMED)])
def test_streamed_bad_input_is_the_same_4xx(server: RunningServer, path, body, status, param) -> None:
    """Everything a plain request checks is checked before a stream's 200 (issue 33: out-of-vocabulary
    ids got 200 and then an error event when streamed)."""
    r = httpx.post(server.url + path, json={**body, "stream": True}, timeout=30)
    _check(r.status_code, dict(r.headers), r.content, status, param)


def test_a_bad_request_does_not_touch_the_ones_beside_it(server: RunningServer) -> None:
    """The overflow that once failed the whole step: with it refused at admission, a concurrent
    stream runs to its end."""
    with httpx.Client(base_url=server.url, timeout=60) as c:
        done: list[str] = []

        def stream() -> None:
            with c.stream("POST", "/v1/completions", json={**COMP, "max_tokens": 24, "ignore_eos": True,
                                                            "stream": True}) as r:
                done.extend(ln for ln in r.iter_lines() if ln.startswith("data: "))

        t = threading.Thread(target=stream)
        t.start()
        for _ in range(3):
            r = c.post("/v1/completions", json={**COMP, "top_k": HUGE})
            assert r.status_code == 400
        t.join()
    assert done[-1] == "data: [DONE]" and '"finish_reason": "length"' in done[-2]


def test_404_quotes_a_non_ascii_model_name(http: httpx.Client) -> None:
    # Error bodies are ASCII-escaped JSON; valid non-ASCII text must still come back intact.
    r = http.post("/v1/completions", json={**COMP, "model": "модель-😀"})
    assert r.status_code == 404 and "модель-😀" in r.json()["error"]["message"]


# --- limits: servers of their own -------------------------------------------------------------------
@pytest.fixture(scope="module")
def small_server(_shared_llm: LLM):
    yield from start_server(_shared_llm, max_num_seqs=2, max_queue=2, max_request_bytes=64 * 1024,
                            request_read_timeout_s=0.5)


def test_more_sequences_than_ever_admitted_is_400(small_server: RunningServer) -> None:
    with httpx.Client(base_url=small_server.url, timeout=60) as c:
        err = _check(*_httpx(c.post("/v1/completions", json={**COMP, "n": 5})), 400, "n")
        assert "at most 4" in err["message"]
        _check(*_httpx(c.post("/v1/completions", json={**COMP, "prompt": ["a"] * 5})), 400, "prompt")
        assert c.post("/v1/completions", json={**COMP, "n": 4}).status_code == 200


def test_body_over_the_limit_is_413(small_server: RunningServer) -> None:
    body = json.dumps({**COMP, "prompt": "x" * 70_000}).encode()
    got = asyncio.run(exchange(small_server.url, request_bytes("POST", "/v1/completions", body)))
    assert "65536" in _check(*got, 413, None)["message"]


def test_body_shorter_than_its_length_is_408(small_server: RunningServer) -> None:
    raw = request_bytes("POST", "/v1/completions", json.dumps(COMP).encode(), content_length=5000)
    got = asyncio.run(exchange(small_server.url, raw, timeout=10))
    _check(*got, 408, None)


def test_huge_header_is_431(small_server: RunningServer) -> None:
    raw = request_bytes("POST", "/v1/completions", COMP, headers={"X-Filler": "a" * 1_000_000})
    got = asyncio.run(exchange(small_server.url, raw))
    _check(*got, 431, None)


def test_long_prompt_is_tokenized_off_the_event_loop(server: RunningServer) -> None:
    """While a 5 MB prompt is tokenized (seconds), /health still answers: it returns before the big
    request does (which then fails its context check)."""
    big = {**COMP, "prompt": "It is a truth universally acknowledged. " * 125_000}

    async def run() -> list[str]:
        order: list[str] = []
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as c:
            async def big_request() -> None:
                r = await c.post("/v1/completions", json=big)
                assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
                order.append("big")

            async def health() -> None:
                await asyncio.sleep(0.5)  # the big body is in and being tokenized
                assert (await c.get("/health")).status_code == 200
                order.append("health")

            await asyncio.gather(big_request(), health())
        return order

    assert asyncio.run(run()) == ["health", "big"]


def _httpx(r: httpx.Response) -> tuple[int, dict[str, str], bytes]:
    return r.status_code, dict(r.headers), r.content
