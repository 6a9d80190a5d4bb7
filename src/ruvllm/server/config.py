"""Settings of the HTTP server (the engine's own settings live in ruvllm.config)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None  # when set, /v1/* needs "Authorization: Bearer <key>"
    served_model_name: str = "default"
    max_concurrent: int = 64  # running sequences (the scheduler's max_num_seqs)
    max_queue: int = 256  # requests allowed to wait beyond max_concurrent before 429
    chat_template: str | None = None  # overrides the model's template
    graceful_shutdown_s: float = 10.0
