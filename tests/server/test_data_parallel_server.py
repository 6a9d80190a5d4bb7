"""`ruvllm serve --data-parallel-size 2` as a real process, through the real `openai` client: both
replicas serve, /metrics has a series per replica, /health lists them, and a replica killed with
SIGKILL mid-stream ends only its own streams (an error event naming the failed replica; the
others finish), is restarted, and the server never stops answering.

The tiny model from a folder (tiny_model_dir): what is tested is the replicas and the routing
front, not the model (tests/e2e/test_data_parallel.py runs the invariants on the default model)."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest

from tests.server.conftest import free_port, wait_healthy
from tests.server.test_serve_process import _children, _wait_gone, stop_mid_stream

SERVE = [sys.executable, "-m", "ruvllm.cli.main", "serve"]


def _metric(text: str, name: str, replica: int) -> float:
    match = re.search(rf'^{re.escape(name)}(?:_total)?{{[^}}]*replica="{replica}"[^}}]*}} (\S+)$', text, re.M)
    assert match, f"{name} for replica {replica} missing from /metrics"
    return float(match.group(1))


@pytest.fixture(scope="module")
def dp_server(tiny_model_dir):
    port = free_port()
    proc = subprocess.Popen([*SERVE, str(tiny_model_dir), "--port", str(port), "--num-blocks", "256",
                             "--served-model-name", "tiny", "--data-parallel-size", "2", "--threads-per-replica", "1",
                             "--drain-timeout", "1"],  # test_zzz's stream outlasts the drain
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        if not wait_healthy(url, proc, tries=480):
            pytest.fail("server exited: " + proc.stderr.read() if proc.poll() is not None else "server did not come up")
        yield proc, url
    finally:
        try:  # the launcher and its replicas, to be gone with the server
            cores = _children(proc.pid) + _replicas(proc.pid) if proc.poll() is None else []
        except ValueError:  # not one launcher now: what is checked is that the server stops
            cores = []
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
        assert all(_wait_gone(pid) for pid in cores), "a replica or the core launcher outlived the server"


def _replicas(server: int) -> list[int]:
    """A data-parallel server's replica cores: the children of its one child, the core launcher
    they fork from (engine/core_launcher.py)."""
    (launcher,) = _children(server)
    return _children(launcher)


def test_both_replicas_serve_and_report(dp_server) -> None:
    proc, url = dp_server
    assert len(_replicas(proc.pid)) == 2
    client = openai.OpenAI(base_url=url + "/v1", api_key="none")
    prompts = [" ".join(f"t{2 + (7 * i + j) % 97}" for j in range(40)) for i in range(12)]
    done = [client.completions.create(model="tiny", prompt=p, max_tokens=8, temperature=0) for p in prompts]
    assert all(c.choices[0].finish_reason in ("stop", "length") for c in done)
    text = httpx.get(url + "/metrics").text
    assert all(_metric(text, "ruvllm:prefix_cache_queries", r) > 0 for r in (0, 1)), "both were meant to serve"
    assert _metric(text, "ruvllm:replica_up", 0) == _metric(text, "ruvllm:replica_up", 1) == 1
    health = httpx.get(url + "/health").json()
    assert [r["status"] for r in health["replicas"]] == ["up", "up"]
    # The same prompt again is a prefix-cache hit: the router sent it where its blocks are.
    again = client.completions.create(model="tiny", prompt=prompts[0], max_tokens=8, temperature=0)
    assert again.choices[0].text == done[0].choices[0].text
    assert again.usage.prompt_tokens_details.cached_tokens > 0


def test_zz_a_killed_replica_ends_only_its_streams_and_is_restarted(dp_server) -> None:
    proc, url = dp_server
    victim = _replicas(proc.pid)[0]
    results: dict[int, str] = {}
    started = threading.Barrier(9, timeout=60)

    def stream(i: int) -> None:
        body = {"model": "tiny", "prompt": f"t{2 + i} " + " ".join(f"t{2 + (i * 13 + j) % 89}" for j in range(30)),
                "max_tokens": 1500, "ignore_eos": True, "stream": True}
        first = True
        try:
            with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
                for line in r.iter_lines():
                    if first and line.startswith("data: {"):
                        first = False
                        started.wait()
                    if line.startswith("data: {") and '"error"' in line:
                        results[i] = json.loads(line[6:])["error"]["code"]
                    elif line.startswith("data: {") and '"finish_reason":"length"' in line.replace(" ", ""):
                        results[i] = "finished"
        except (httpx.HTTPError, threading.BrokenBarrierError) as exc:
            results[i] = f"transport: {exc!r}"

    threads = [threading.Thread(target=stream, args=(i,), daemon=True) for i in range(8)]
    for t in threads:
        t.start()
    started.wait()  # every stream has its first token
    subprocess.run(["kill", "-9", str(victim)], check=True)
    for t in threads:
        t.join(120)
    assert len(results) == 8, results
    assert set(results.values()) <= {"finished", "replica_failed"}, results
    assert "replica_failed" in results.values() and "finished" in results.values(), results
    assert proc.poll() is None, "the server stopped with one replica"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        health = httpx.get(url + "/health").json()
        if [r["status"] for r in health["replicas"]] == ["up", "up"]:
            break
        time.sleep(0.25)
    assert [r["status"] for r in health["replicas"]] == ["up", "up"], health
    assert sum(r["restarts"] for r in health["replicas"]) == 1
    assert victim not in _replicas(proc.pid)
    text = httpx.get(url + "/metrics").text
    assert _metric(text, "ruvllm:replica_restarts", 0) + _metric(text, "ruvllm:replica_restarts", 1) == 1
    client = openai.OpenAI(base_url=url + "/v1", api_key="none")
    for i in range(4):  # served after the restart, wherever they land
        assert client.completions.create(model="tiny", prompt=f"t{40 + i} t5 t6", max_tokens=4).choices[0].text is not None
    for r in (0, 1):  # no block leaked on either replica (the killed one's pool is a new one)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            text = httpx.get(url + "/metrics").text
            if _metric(text, "ruvllm:kv_cache_usage_perc", r) == 0 and _metric(text, "ruvllm:num_requests_running", r) == 0:
                break
            time.sleep(0.1)
        assert _metric(text, "ruvllm:kv_cache_usage_perc", r) == 0


def test_zzz_sigterm_stops_the_server_with_exit_0(dp_server) -> None:
    """Last (it stops the module's server), and the SIGTERM half of test_serve_process.py's signal
    test, as the stop a supervisor sends: exit 0, the in-flight stream ended by the drain, both
    replicas' cores gone."""
    proc, url = dp_server
    cores = _replicas(proc.pid)
    assert len(cores) == 2
    cores += _children(proc.pid)  # and the launcher
    stop_mid_stream(proc, url, signal.SIGTERM)
    assert all(_wait_gone(pid) for pid in cores), "a replica outlived the server"
