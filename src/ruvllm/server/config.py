"""Settings of the HTTP server and of its Ray Serve deployment (the engine's own settings live in
ruvllm.config), declared as the engine's are: `ruvllm serve`, `ruvllm ray-serve` and Ray's `serve
run` take the flags and arguments generated from these fields. No Ray here: the CLI declares its
flags where Ray is not installed."""

from __future__ import annotations

from dataclasses import dataclass, field

from ruvllm.config import Checked, EngineConfig, setting
from ruvllm.engine.router import RouterConfig
from ruvllm.learning.config import LearningConfig
from ruvllm.tools.parsers import PARSERS
from ruvllm.tools.reasoning import OFF, ReasoningTags


@dataclass(frozen=True)
class ServerConfig(Checked):
    host: str = setting("127.0.0.1", "Interface to bind (ray-serve: of Ray Serve's HTTP proxy).")
    port: int = setting(8000, "Port to bind (ray-serve: of Ray Serve's HTTP proxy).", minimum=0, maximum=65535)
    grpc_port: int | None = setting(None, "Also serve the gRPC API (src/ruvllm/grpc/ruvllm.proto) on this port, same "
                                          "interface, same engine (default: no gRPC).", minimum=0, maximum=65535)
    api_key: str | None = setting(None, "Require 'Authorization: Bearer KEY' on every route but /health.",
                                  envvar="RUVLLM_API_KEY")
    admin_key: str | None = setting(None, "The operator's key: loading and unloading adapters need it (default: "
                                          "--api-key); its requests are no tenant's.",
                                    envvar="RUVLLM_ADMIN_KEY")
    # Keys of tenants (--api-keys FILE): each key admits its requests as its tenant's. With either
    # this or api_key, every route but /health needs a key.
    api_keys: tuple[tuple[str, str], ...] = setting((), "Tenants' (key, tenant) pairs.", cli=False)
    routes_without_key: tuple[str, ...] = setting(
        (), "With --api-key: serve PATH without the key (repeatable).", flag="--route-without-key", metavar="PATH")
    served_model_name: str = setting("default", "Model id clients send (default: MODEL as given).")
    max_queue: int = setting(256, "Sequences that may wait beyond --max-num-seqs; then 429.", minimum=0)
    chat_template: str | None = setting(None, "Jinja chat template, or a path to one (default: the model's).")
    tool_parser: str | None = setting(None, "How tool calls are read from the model's text (default: from the chat "
                                            "template).", choices=tuple(PARSERS), metavar="NAME")
    reasoning_tags: str | None = setting(
        None, "The tags a thinking model writes its reasoning between, served apart from its answer (default: "
              "<think>,</think> when the chat template mentions <think> or enable_thinking; `off`: none).",
        metavar="START,END")
    # How /v1/rerank and /v1/score score a pair (server/rerank.py): what the served model is for
    score_mode: str = setting("logits", "How /v1/rerank and /v1/score score a pair: logits (a yes/no judgment by a "
                                        "chat or reranker model: p(yes) / (p(yes) + p(no))) or embedding (the cosine "
                                        "of the two texts' vectors, for an embedding model).",
                              choices=("logits", "embedding"))
    graceful_shutdown_s: float = setting(10.0, "Seconds in-flight requests get to finish after SIGINT/SIGTERM.",
                                         flag="--drain-timeout", minimum=0)
    max_request_bytes: int = setting(16 * 2**20, "Largest request body; a larger one gets 413 (a 128k-token prompt "
                                                 "is ~1 MB).", minimum=1)
    request_read_timeout_s: float = setting(30.0, "Seconds a request body may stall between chunks; then 408.",
                                            flag="--request-read-timeout", minimum=0.1)
    # Longer than the idle expiry of the clients' connection pools (httpx, so openai and anthropic: 5 s;
    # aiohttp: 15 s; Go: 90 s): the client then always drops an idle connection first. uvicorn's 5 s equalled
    # httpx's, and a request sent on a connection the server was closing at that moment failed with a
    # reset before any byte of its answer (the 64-client soak on a loaded host, alternated: requests lost in
    # 5 of 60 runs at 5 s, in none of 60 at 100 s: docs/decisions.md).
    http_keep_alive_s: int = setting(100, "Seconds an idle HTTP connection is kept open for its next request.",
                                       flag="--timeout-keep-alive", minimum=1)
    # The stored responses of POST /v1/responses (server/response_store.py): in memory, oldest dropped first
    responses_store_max: int = setting(1000, "Stored responses (/v1/responses with store) kept at most, all tenants "
                                             "together; 0: none are kept.", minimum=0)
    responses_store_bytes: int = setting(64 * 2**20, "Bytes of stored responses kept at most (their JSON), all "
                                                     "tenants together.", minimum=1)
    responses_store_ttl_s: float = setting(3600.0, "Seconds a stored response is kept.", flag="--responses-store-ttl",
                                           minimum=1)
    # Where POST /v1/load_lora_adapter may read adapters: under these folders, or exactly the paths
    # given at start-up (--lora), or anywhere with allow_any_lora_path.
    lora_dirs: tuple[str, ...] = setting((), "POST /v1/load_lora_adapter may read adapters under DIR (repeatable).",
                                         flag="--lora-dir", metavar="DIR")
    startup_lora_paths: tuple[str, ...] = setting((), "The adapters' paths given at start-up.", cli=False)
    allow_any_lora_path: bool = setting(False, "POST /v1/load_lora_adapter may read adapters from any path.",
                                        flag="--allow-any-lora-path")
    # The witness log (SQLite, hash-chained): every completion recorded there; None: not kept.
    witness_log: str | None = setting(
        None, "The witness log of every completion (SQLite, hash-chained; default: $RUVLLM_DATA_DIR or "
              "~/.local/share/ruvllm, witness.sqlite3; `off`: none).", metavar="PATH")
    witness_store_tokens: bool = setting(False, "Keep prompt and output token ids in the witness log, not only "
                                                "their hashes.", flag="--witness-store-tokens")
    witness_key_file: str | None = setting(None, "Sign the witness log's head (its entry count and last hash) "
                                                 "after every commit with the HMAC key in FILE, written beside the "
                                                 "log as LOG.head, so a cut or rewritten tail is caught (`ruvllm "
                                                 "witness verify --key-file`).", metavar="FILE")
    # Learning from feedback (POST /v1/feedback; None: off). The engine needs LoRA slots of at least
    # the micro-LoRA's rank.
    learning: LearningConfig | None = None
    feedback_rate: float = setting(2.0, "With --learn: feedback events a second per tenant (bursts of "
                                        "feedback_burst); then 429.", minimum=0.001)
    feedback_burst: int = setting(10, "Feedback events a tenant may send at once.", minimum=1, cli=False)
    # None: on without keys, off with any (docs/decisions.md: who may learn).
    learn_user_tenants: bool | None = setting(
        None, "With --learn: tenants named by the `user` field, not by a key, may send feedback (default: yes on "
              "a server without keys, no with any key).", flag="--learn-user-tenants/--no-learn-user-tenants")
    max_waiting_updates: int = setting(32, "Feedback events queued for the update thread, all tenants; then 429.",
                                       minimum=0, cli=False)
    deep_every: float = setting(0.0, "With --learn: run the deep loop (ruvllm learn run) for a tenant once its "
                                     "feedback since the last run weighs WEIGHT (the sum of |score|; a correction "
                                     "weighs 1; 0: never).", minimum=0, metavar="WEIGHT")
    deep_heldout: str | None = setting(None, "The deep loop's held-out text.", metavar="FILE")
    deep_general: str | None = setting(None, "The deep loop's everyday text.", metavar="FILE")
    deep_probes: str | None = setting(None, "The deep loop's probes (JSON lines).", metavar="FILE")

    # Many models (--model NAME=SOURCE, repeated; server/model_pool.py): loaded on demand, unloaded when idle
    keep_alive_s: float = setting(300.0, "With several models: seconds a model stays loaded after its last request "
                                         "(a request's own keep_alive wins; negative: for ever).",
                                  flag="--keep-alive", metavar="SECONDS")
    max_memory_gib: float | None = setting(None, "With several models: GiB the loaded models' weights and KV caches "
                                                 "may take together; a load past it first unloads the least recently "
                                                 "used idle model (default: no bound).", flag="--max-memory",
                                           minimum=0.001, metavar="GIB")
    preload: tuple[str, ...] = setting((), "With several models: load model NAME at start, not on its first request "
                                           "(repeatable).", flag="--preload", metavar="NAME")

    def check_across(self) -> None:
        if self.reasoning_tags is not None and self.reasoning_tags.strip().lower() != OFF:
            ReasoningTags.parse(self.reasoning_tags)  # a ValueError naming the setting's form


@dataclass(frozen=True)
class RayServeConfig(Checked):
    """What `ruvllm ray-serve` deploys (ray_serve/app.py)."""

    engine: EngineConfig = field(default_factory=EngineConfig)
    server: ServerConfig = field(default_factory=ServerConfig)
    routing: RouterConfig = field(default_factory=RouterConfig)
    replicas: int = setting(1, "Engine replicas (without autoscaling).", minimum=1)
    min_replicas: int | None = setting(None, "Autoscale between --min-replicas and --max-replicas on ongoing "
                                             "requests per replica (Ray Serve's autoscaler).", minimum=0)
    max_replicas: int | None = setting(None, "With --min-replicas.", minimum=1)
    target_ongoing_requests: float = setting(16.0, "With autoscaling: the queue depth per replica aimed at.",
                                             minimum=0.1)
    cpus_per_replica: float = setting(1.0, "CPUs Ray reserves for each engine replica (set --threads to match).",
                                      minimum=0.1)
    max_ongoing_requests: int = setting(256, "Requests one engine replica takes at once; Serve queues the rest.",
                                        minimum=1, cli=False)

    def check_across(self) -> None:
        if self.server.grpc_port is not None:  # each front replica would bind it; Ray Serve has its own gRPC proxy
            raise ValueError("grpc_port: the gRPC API is served by `ruvllm serve`, not on Ray Serve")
        if (self.min_replicas is None) != (self.max_replicas is None):
            raise ValueError("autoscaling needs both min_replicas and max_replicas")
        if self.min_replicas is not None and not self.min_replicas <= self.max_replicas:  # type: ignore[operator]
            raise ValueError(f"min_replicas ({self.min_replicas}) must not exceed max_replicas ({self.max_replicas})")
