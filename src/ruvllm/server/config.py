"""Settings of the HTTP server (the engine's own settings live in ruvllm.config)."""

from __future__ import annotations

from dataclasses import dataclass

from ruvllm.learning.config import LearningConfig


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None  # when set, every route but /health needs "Authorization: Bearer <key>"
    # Keys of tenants (--api-keys FILE): each key admits its requests as its tenant's. With either
    # this or api_key, every route but /health needs a key.
    api_keys: tuple[tuple[str, str], ...] = ()
    routes_without_key: tuple[str, ...] = ()  # paths the operator opens without the key (e.g. /metrics)
    served_model_name: str = "default"
    # Sequences allowed to wait beyond the engine's running cap (EngineInfo.max_num_seqs) before 429.
    max_queue: int = 256
    chat_template: str | None = None  # overrides the model's template
    tool_parser: str | None = None  # hermes | llama3_json (None: from the chat template; docs/structured.md)
    graceful_shutdown_s: float = 10.0
    max_request_bytes: int = 16 * 2**20  # a larger body gets 413 (a 128k-token prompt is ~1 MB)
    request_read_timeout_s: float = 30.0  # a body that stalls this long between chunks gets 408
    # Where POST /v1/load_lora_adapter may read adapters: under these folders, or exactly the paths
    # given at start-up (--lora), or anywhere with allow_any_lora_path.
    lora_dirs: tuple[str, ...] = ()
    startup_lora_paths: tuple[str, ...] = ()
    allow_any_lora_path: bool = False
    # The witness log (SQLite, hash-chained): every completion recorded there; None: not kept.
    witness_log: str | None = None
    witness_store_tokens: bool = False  # the prompt and output token ids too, not only their hashes
    # Learning from feedback (POST /v1/feedback; None: off). The engine needs LoRA slots of at least
    # the micro-LoRA's rank.
    learning: LearningConfig | None = None
    feedback_rate: float = 2.0  # events a second per tenant (bursts of feedback_burst); then 429
    feedback_burst: int = 10
    max_waiting_updates: int = 32  # feedback events queued for the update thread, all tenants; then 429
    # The deep loop, triggered: once a tenant's feedback since its last run weighs this much (the sum of
    # |score|, a correction weighing 1; 0: never), `ruvllm learn run TENANT` in a low-priority process
    # of its own, with these files (held-out text needed).
    deep_every: float = 0.0
    deep_heldout: str | None = None
    deep_general: str | None = None
    deep_probes: str | None = None
