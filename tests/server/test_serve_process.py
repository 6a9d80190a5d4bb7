"""`ruvllm serve` as a real process: stops cleanly on SIGINT (exit 0, in-flight requests ended; the
same on SIGTERM in test_data_parallel_server.py), a dead core fails every stream (and a killed
front's core leaves by itself: test_cli_chat.py), and a bad model is one line and a non-zero exit.

The servers run the tiny model from a folder (tiny_model_dir): what is tested here is the process
and its signals, not the model; the embedded model's serving is tested through the same app in
tests/server/ and through `serve` in benchmarks/serve_load.py."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.server.conftest import free_port, wait_healthy

SERVE = [sys.executable, "-m", "ruvllm.cli.main", "serve"]


def test_sigint_stops_the_server_with_exit_0(tiny_model_dir) -> None:
    """SIGTERM, the other stop signal, is sent to the data-parallel server at the end of
    tests/server/test_data_parallel_server.py with the same checks: a server start less here."""
    sig = signal.SIGINT
    port = free_port()
    # A short drain: the stream below outlasts it, so it is aborted (and must end) either way.
    proc = subprocess.Popen([*SERVE, str(tiny_model_dir), "--port", str(port), "--num-blocks", "256",
                             "--drain-timeout", "1", "--served-model-name", "tiny"],
                            stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        url = f"http://127.0.0.1:{port}"
        if not wait_healthy(url, proc):
            pytest.fail("server did not come up: " + proc.stderr.read() if proc.poll() is not None else "timeout")
        (core,) = _children(proc.pid)  # the engine core's process
        stop_mid_stream(proc, url, sig)
        assert _wait_gone(core), "the engine core outlived the server"
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


def _children(pid: int) -> list[int]:
    """Child processes of `pid` (Linux /proc): the engine core that `ruvllm serve` spawned."""
    kids: list[int] = []
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/children") as f:
            kids += [int(k) for k in f.read().split()]
    return kids


def _front_folder(core: int) -> Path:
    """The folder of the command socket an engine core process connects to (its front's, which the
    core removes when it finds its front gone), from the core's command line."""
    address = next(a for a in Path(f"/proc/{core}/cmdline").read_bytes().split(b"\0") if a.startswith(b"ipc://"))
    return Path(address.decode().removeprefix("ipc://")).parent


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1].startswith("Z")  # a zombie has exited (its parent is gone too)
    except FileNotFoundError:
        return True


def _wait_gone(pid: int, timeout: float = 10) -> bool:
    deadline = time.monotonic() + timeout
    while not _gone(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    return _gone(pid)


def _start(port: int, model) -> subprocess.Popen:
    proc = subprocess.Popen([*SERVE, str(model), "--port", str(port), "--num-blocks", "512", "--drain-timeout", "1"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if wait_healthy(f"http://127.0.0.1:{port}", proc):
        return proc
    proc.kill()
    pytest.fail("server did not come up: " + proc.stderr.read())


def test_killed_core_fails_every_stream_within_2s_and_the_server_exits_1(tiny_model_dir) -> None:
    port = free_port()
    proc = _start(port, tiny_model_dir)
    try:
        (core,) = _children(proc.pid)
        url = f"http://127.0.0.1:{port}/v1/completions"
        streaming = threading.Barrier(17)
        errors_at: list[float] = []

        def stream(i: int) -> None:
            body = {"prompt": f"Chapter {i}.", "max_tokens": 4000, "stream": True, "ignore_eos": True}
            with httpx.stream("POST", url, json=body, timeout=30) as r:
                lines = r.iter_lines()
                next(line for line in lines if line.startswith("data: {"))
                streaming.wait()
                for line in lines:
                    if '"engine_failed"' in line:
                        errors_at.append(time.monotonic())

        threads = [threading.Thread(target=stream, args=(i,), daemon=True) for i in range(16)]
        for t in threads:
            t.start()
        streaming.wait(timeout=120)
        os.kill(core, signal.SIGKILL)
        killed = time.monotonic()
        for t in threads:
            t.join(timeout=10)
        assert len(errors_at) == 16, "every open stream gets an engine_failed error event"
        assert max(errors_at) - killed < 2.0, [round(t - killed, 2) for t in errors_at]
        assert proc.wait(timeout=30) == 1  # it stops on its own, non-zero, for a supervisor to restart
        assert "engine" in proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()


# A killed front leaves no orphan core (SIGKILL gives it no chance to stop its child; the core notices
# and leaves by itself): tests/e2e/test_cli_chat.py kills `ruvllm chat`, whose core is this one, at
# the end of its adapter test, rather than a server being started here only to be killed.


def stop_mid_stream(proc: subprocess.Popen, url: str, sig: int) -> None:
    """`sig` sent to a `ruvllm serve` (started with --drain-timeout 1) while a long stream runs: it
    exits 0, and the stream is ended by the drain, not left to run to its end."""
    streaming, ended = threading.Event(), threading.Event()
    chunks: list[str] = []

    def long_stream() -> None:
        body = {"model": "tiny", "messages": [{"role": "user", "content": "Count to 1000"}],
                "max_tokens": 3000, "stream": True, "ignore_eos": True}
        try:
            with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=60) as r:
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        chunks.append(line)
                        streaming.set()
        except httpx.HTTPError:
            pass
        ended.set()

    threading.Thread(target=long_stream, daemon=True).start()
    assert streaming.wait(30), "the stream did not start"
    proc.send_signal(sig)  # mid-reply: 3000 tokens outlast the 1 s drain
    assert not ended.is_set()
    assert proc.wait(timeout=60) == 0, proc.stderr.read()
    assert ended.wait(10), "the in-flight stream was not ended"
    # Cut by the drain (a request just started counts as in flight), not left to run to its end.
    assert len(chunks) < 3000 and '"finish_reason":"length"' not in chunks[-1].replace(" ", ""), chunks[-1]
