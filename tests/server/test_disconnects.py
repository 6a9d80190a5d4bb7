"""The engine never dies from a client (issue 12): requests dropped at every point, a soak with random
drops, and - when the engine fails anyway - a loud failure: every open request gets its error,
/health says so, and the server stops so a supervisor can restart it."""

from __future__ import annotations

import asyncio
import socket
import threading
import time

import httpx
import pytest

from benchmarks.adversarial_clients import disconnect_fuzz, soak
from ruvllm import LLM, CacheConfig, SchedulerConfig
from ruvllm.engine.async_engine import AsyncEngine
from ruvllm.errors import EngineDeadError
from ruvllm.messages import EngineStats
from ruvllm.server.app import create_app
from ruvllm.server.config import ServerConfig
from ruvllm.server.process import serve
from tests.server.conftest import MODEL, RunningServer, free_port, start_server, wait_healthy

COMP = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 200, "ignore_eos": True}


def _settled(server: RunningServer, timeout: float = 30.0) -> EngineStats:
    """Engine idle and every admission slot back; then the KV pool must be whole."""
    deadline = time.monotonic() + timeout
    while server.sequences_admitted and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server.sequences_admitted == 0, "admission slots leaked"
    stats = server.wait_idle(timeout)
    assert stats.running == 0 and stats.waiting == 0
    assert stats.free_blocks == stats.total_blocks, "KV blocks leaked"
    return stats


@pytest.fixture(scope="module")
def tiny_server(_tiny_llm: LLM):
    """The clients' behaviour is the point here, not the model: the tiny one turns requests around
    in milliseconds, so the fuzz and the soak put many more through the same checks."""
    yield from start_server(_tiny_llm)


def test_disconnect_fuzz_leaves_the_engine_alive_and_whole(tiny_server: RunningServer) -> None:
    server = tiny_server
    result = asyncio.run(disconnect_fuzz(server.url, 200, MODEL, seed=12))
    assert not result.failures, result.failures[:3]
    assert set(result.drops) == {"partial-request", "after-send", "after-first-byte", "mid-body", "complete"}
    assert server.engine.is_alive
    assert httpx.get(f"{server.url}/health").status_code == 200
    _settled(server)
    r = httpx.post(f"{server.url}/v1/completions", json={**COMP, "max_tokens": 4}, timeout=60)
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length"


def test_soak_with_random_drops_loses_nothing(tiny_server: RunningServer) -> None:
    server = tiny_server
    # Until 257 requests completed and 17 were dropped (a count of requests is the point, not a rate
    # nor a duration: a fixed 6 s also ran on well past those counts, 64 clients keeping both cores busy).
    result = asyncio.run(soak(server.url, seconds=0, clients=64, drop_rate=0.1, model=MODEL, seed=7,
                              min_completed=257, min_dropped=17, max_seconds=60))
    assert not result.lost, result.lost[:3]
    assert not [s for s in result.statuses if s >= 500], result.statuses
    assert result.completed > 256 and result.dropped > 16, (result.completed, result.dropped)
    _settled(server)


def _idle_then_ask(url: str, idle_s: float) -> bytes:
    """One request on a raw connection, `idle_s` of silence, a second request on the same connection:
    the start of its answer (b"" where the server had closed the connection meanwhile)."""
    host, port = url.removeprefix("http://").split(":")
    ask = f"GET /health HTTP/1.1\r\nHost: {host}\r\n\r\n".encode()
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(ask)
        assert s.recv(4096).startswith(b"HTTP/1.1 200")
        time.sleep(idle_s)
        try:
            s.sendall(ask)
            return s.recv(4096)
        except ConnectionError:
            return b""


def test_an_idle_connection_outlives_the_clients_pool_expiry(tiny_server: RunningServer, _tiny_llm: LLM) -> None:
    # httpx (and so the openai and anthropic clients) drops a connection idle for 5 s; uvicorn's own 5 s
    # made the two race, and a request sent into the server's close was lost (the soak above, on a loaded
    # host). So the server keeps an idle connection well past a client pool's expiry...
    assert tiny_server.cfg.http_keep_alive_s > 15
    assert _idle_then_ask(tiny_server.url, 1.5).startswith(b"HTTP/1.1 200")
    # ...and the setting is what decides it: at 1 s the same connection is closed.
    for short in start_server(_tiny_llm, http_keep_alive_s=1):
        assert _idle_then_ask(short.url, 1.5) == b""


# --- the engine fails anyway: fault injection (a step that raises, as a lost device would) ----------
def _break(engine: AsyncEngine) -> None:
    def step() -> list:
        raise RuntimeError("injected fault: the device went away")
    # No public hook for fault injection: the in-process client's EngineCore (private) is made to fail.
    engine._client.core.step = step  # type: ignore[attr-defined, method-assign]


def test_engine_failure_fails_open_requests_and_health(_shared_llm: LLM) -> None:
    for srv in start_server(_shared_llm):
        with httpx.Client(base_url=srv.url, timeout=30) as c:
            with c.stream("POST", "/v1/completions", json={**COMP, "stream": True}) as r:
                lines = r.iter_lines()
                next(ln for ln in lines if ln.startswith("data: {"))
                _break(srv.engine)
                rest = [ln for ln in lines if ln.startswith("data: ")]
            assert '"code": "engine_failed"' in rest[-2] and rest[-1] == "data: [DONE]", rest[-3:]
            health = c.get("/health")
            assert health.status_code == 503 and "injected fault" in health.json()["error"]["message"]
            # Later requests get an error at once, never a hang.
            r = c.post("/v1/completions", json=COMP)
            assert r.status_code == 500 and r.json()["error"]["code"] == "engine_failed"
        assert srv.sequences_admitted == 0


def test_serve_stops_when_the_engine_fails(_shared_llm: LLM) -> None:
    small = _shared_llm.with_settings(cache=CacheConfig(num_blocks=64), scheduler=SchedulerConfig(max_num_seqs=4))
    engine = small.async_engine()
    port = free_port()
    app = create_app(engine, ServerConfig(port=port, served_model_name=MODEL), owns_engine=True)
    outcome: dict[str, object] = {}

    def run() -> None:
        try:
            outcome["started"] = serve(app, engine, "127.0.0.1", port, drain_s=1)
        except BaseException as exc:
            outcome["error"] = exc

    t = threading.Thread(target=run, daemon=True)
    t.start()
    url = f"http://127.0.0.1:{port}"
    assert wait_healthy(url, tries=200)
    _break(engine)
    assert httpx.post(f"{url}/v1/completions", json=COMP, timeout=30).status_code == 500
    t.join(timeout=30)
    assert not t.is_alive(), "the server kept running with a dead engine"
    assert isinstance(outcome.get("error"), EngineDeadError), outcome


@pytest.mark.parametrize("when", ["queued", "running"])
def test_cancel_at_any_point_of_the_hand_off(_shared_llm: LLM, when: str) -> None:
    """The engine's own hand-off, without HTTP: callers cancelled while their add waits behind a
    busy engine, or while they stream, leave nothing behind and the engine keeps serving."""
    small = _shared_llm.with_settings(cache=CacheConfig(num_blocks=128), scheduler=SchedulerConfig(max_num_seqs=8))
    engine = small.async_engine()
    from ruvllm import SamplingParams

    async def consume(i: int) -> None:
        async for _ in engine.generate([1, 2, 3, 4 + i], SamplingParams(max_tokens=64, ignore_eos=True)):
            pass

    async def main() -> None:
        tasks = [asyncio.create_task(consume(i)) for i in range(24)]
        await asyncio.sleep(0 if when == "queued" else 0.3)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        out = [o async for o in engine.generate([5, 6, 7], SamplingParams(max_tokens=3, ignore_eos=True))]
        assert out[-1].finished and len(out[-1].outputs[0].token_ids) == 3

    try:
        asyncio.run(main())
        assert engine.is_alive
        stats = engine.stats()
        assert stats.running == stats.waiting == 0 and stats.free_blocks == stats.total_blocks
    finally:
        engine.shutdown()
