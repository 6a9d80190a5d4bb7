"""Running the app under uvicorn as a process that stops cleanly on SIGINT / SIGTERM, and loudly when
its engine fails."""

from __future__ import annotations

import threading
import time
from types import FrameType
from typing import Any

import uvicorn

from ruvllm.engine.async_engine import AsyncEngine
from ruvllm.errors import EngineDeadError
from ruvllm.server.http11 import RuvllmHttpToolsProtocol
from ruvllm.server.model_pool import ModelPool


def uvicorn_config(app: Any, host: str, port: int, drain_s: float) -> uvicorn.Config:
    """The one uvicorn configuration the server runs with (tests use it too); the rest of its settings
    are the app's ServerConfig's."""
    cfg = app.state.server_cfg
    return uvicorn.Config(app, host=host, port=port, log_level="warning", timeout_graceful_shutdown=int(drain_s) + 5,
                          timeout_keep_alive=cfg.http_keep_alive_s, http=RuvllmHttpToolsProtocol)


class GracefulServer(uvicorn.Server):
    """On the first signal: stop accepting, give in-flight requests `drain_s` to finish, then abort
    the rest (their streams end with an error event), and exit normally (status 0) - a signal is how
    a server is asked to stop, not a failure. A second SIGINT forces the exit.

    If the engine fails, the server stops at once (every open request has already had its error)
    and `engine_failure` says why, so the process can exit non-zero and a supervisor restart it: a
    server whose engine is gone must not stay up answering nothing."""

    def __init__(self, config: uvicorn.Config, engine: AsyncEngine | ModelPool, drain_s: float) -> None:
        super().__init__(config)
        self.engine, self.drain_s = engine, drain_s
        self._draining = False
        self.engine_failure: EngineDeadError | None = None
        engine.on_failure(self._engine_failed)

    def _engine_failed(self, error: EngineDeadError) -> None:
        self.engine_failure = error
        self.should_exit = True  # uvicorn's main loop polls it

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        super().handle_exit(sig, frame)
        self._captured_signals.clear()  # uvicorn would re-raise it after shutdown: exit 130 / -15
        if not self._draining:
            self._draining = True
            threading.Thread(target=self._drain, name="ruvllm-drain", daemon=True).start()

    def _drain(self) -> None:
        # Idle is the server's count of admitted sequences, not the core's last published stats: a
        # request that has just started streaming may not be in those yet.
        models = self.config.app.state.models  # server/model_pool.py: every loaded model's admission
        deadline = time.monotonic() + self.drain_s
        while time.monotonic() < deadline:
            if models.in_flight == 0:
                return
            time.sleep(0.05)
        self.engine.abort_all()


def serve(app: Any, engine: AsyncEngine | ModelPool, host: str, port: int, drain_s: float) -> bool:
    """Run until stopped; False if the server could not start (e.g. the port is taken). `engine`: the one
    model's, or a many-model server's pool (a model's failure unloads only that model there).
    Raises EngineDeadError after stopping if it stopped because the engine failed."""
    server = GracefulServer(uvicorn_config(app, host, port, drain_s), engine, drain_s)
    try:
        server.run()
    except SystemExit:  # uvicorn exits the process when it cannot bind; we report it ourselves
        return False
    if server.engine_failure is not None:
        raise server.engine_failure
    return server.started
