"""`ruvllm serve` as a real process: starts on the embedded model, stops cleanly on SIGINT/SIGTERM
(exit 0, in-flight requests ended), and a bad model is one line and a non-zero exit."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest

SERVE = [sys.executable, "-m", "ruvllm.cli.main", "serve"]


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_signal_stops_the_server_with_exit_0(sig: signal.Signals) -> None:
    port = _port()
    # A short drain: the stream below outlasts it, so it is aborted (and must end) either way.
    proc = subprocess.Popen([*SERVE, "--port", str(port), "--num-blocks", "256", "--drain-timeout", "1"],
                            stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        url = f"http://127.0.0.1:{port}"
        for _ in range(240):
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.25)
        else:
            pytest.fail("server did not come up: " + proc.stderr.read() if proc.poll() is not None else "timeout")
        ended = threading.Event()

        def long_stream() -> None:
            body = {"model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": "Count to 1000"}],
                    "max_tokens": 3000, "stream": True, "ignore_eos": True}
            try:
                with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=60) as r:
                    for _ in r.iter_lines():
                        pass
            except httpx.HTTPError:
                pass
            ended.set()

        t = threading.Thread(target=long_stream, daemon=True)
        t.start()
        time.sleep(1.5)
        proc.send_signal(sig)
        assert proc.wait(timeout=60) == 0, proc.stderr.read()
        assert ended.wait(10), "the in-flight stream was not ended"
    finally:
        if proc.poll() is None:
            proc.kill()


def test_missing_model_is_one_line_and_nonzero(tmp_path) -> None:
    r = subprocess.run([*SERVE, str(tmp_path / "nope.gguf")], capture_output=True, text=True, timeout=120)
    assert r.returncode != 0
    lines = [ln for ln in r.stderr.strip().splitlines() if ln.strip()]
    assert len(lines) == 1 and "nope.gguf" in lines[0] and "Traceback" not in r.stderr


def test_port_in_use_is_one_line(tmp_path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        r = subprocess.run([*SERVE, "--port", str(port), "--num-blocks", "64"], capture_output=True, text=True,
                           timeout=180)
    assert r.returncode != 0
    assert "Traceback" not in r.stderr and "in use" in r.stderr
