"""A real server (uvicorn in a thread, real sockets) over the shared default model, for the real
`openai` client and raw HTTP. Each server gets its own KV pool and scheduler over the loaded model."""

from __future__ import annotations

import random
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
import uvicorn

from ruvllm import LLM, CacheConfig, SchedulerConfig
from ruvllm.engine.async_engine import AsyncEngine
from ruvllm.messages import EngineStats
from ruvllm.server.app import create_app
from ruvllm.server.config import ServerConfig
from ruvllm.server.process import uvicorn_config

MODEL = "smollm2-test"


@dataclass
class RunningServer:
    url: str
    engine: AsyncEngine
    cfg: ServerConfig
    app: Any

    @property
    def sequences_admitted(self) -> int:
        """Sequences the server counts as in flight (its admission slots)."""
        return self.app.state.ruvllm.admission.in_flight

    def wait_idle(self, timeout: float = 30.0) -> EngineStats:
        """Until nothing runs or waits; then every block must be back in the pool."""
        deadline = time.monotonic() + timeout
        while True:
            stats = self.engine.stats()
            if stats.idle or time.monotonic() > deadline:
                return stats
            time.sleep(0.05)


def free_port() -> int:
    """A free port for a server to listen on, from 20000-32767: below the kernel's ephemeral range
    (32768+), where every outgoing connection and Ray's many processes take ports, and above Ray's worker
    ports (10002-19999). A port the kernel hands out from its ephemeral range was taken again by Ray before
    its proxy could bind it (a fresh-clone CI run)."""
    rng = random.Random()
    while True:
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", rng.randrange(20000, 32768)))
            except OSError:
                continue
            return s.getsockname()[1]


def wait_healthy(url: str, proc: Any = None, tries: int = 240, ready: Any = None) -> bool:
    """Polls `url`/health every 0.25 s, at most `tries` times, through one client: True once it answers
    200 (and `ready()`, where given, holds); False when `proc` (a Popen) exits first or the tries run out.
    One client, because each new one (httpx.get's, openai's) builds an SSL context from certifi's
    bundle, ~54 ms of CPU here, even for plain HTTP: the server starts' polls cost the suite ~40 s of
    CPU (py-spy, session 27)."""
    with httpx.Client(timeout=2) as client:
        for _ in range(tries):
            if proc is not None and proc.poll() is not None:
                return False
            try:
                if client.get(url + "/health").status_code == 200 and (ready is None or ready()):
                    return True
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
    return False


@contextmanager
def serving(app: Any, port: int, join_s: float = 10.0) -> Iterator[str]:
    """`app` on uvicorn in a thread of this process until the block ends; yields its URL."""
    server = uvicorn.Server(uvicorn_config(app, "127.0.0.1", port, drain_s=0))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    for _ in range(400):
        if server.started:
            break
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=join_s)


def start_server(llm: LLM, max_num_seqs: int = 32, **server_kwargs) -> Iterator[RunningServer]:
    """max_num_seqs: the engine's running cap, which the server admits (plus max_queue waiting)."""
    sched = SchedulerConfig(max_num_seqs=max_num_seqs)
    engine = llm.with_settings(cache=CacheConfig(num_blocks=512), scheduler=sched).async_engine()
    port = free_port()
    cfg = ServerConfig(port=port, served_model_name=MODEL, **server_kwargs)
    app = create_app(engine, cfg)
    try:
        with serving(app, port) as url:
            running = RunningServer(url, engine, cfg, app)
            yield running
            if engine.failure is None:  # a failed engine (the failure tests) has no pool to check
                stats = running.wait_idle()
                assert stats.free_blocks == stats.total_blocks, "KV blocks leaked"
    finally:
        engine.shutdown()


@pytest.fixture(scope="module")
def server(_shared_llm: LLM) -> Iterator[RunningServer]:
    yield from start_server(_shared_llm)


@pytest.fixture
def http(server: RunningServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=60) as client:
        yield client
    stats = server.wait_idle()
    assert stats.free_blocks == stats.total_blocks, "KV blocks leaked"
