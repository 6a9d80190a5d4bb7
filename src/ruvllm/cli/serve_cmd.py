"""`ruvllm serve [MODEL]`: the OpenAI-compatible HTTP server."""

from __future__ import annotations

import socket
from pathlib import Path

import typer

from ruvllm.cli.common import CliState, clean_errors, fail
from ruvllm.cli.engine_options import EngineFlags, with_engine_flags
from ruvllm.learning.config import LearningConfig
from ruvllm.server.config import ServerConfig
from ruvllm.server.tenants import read_api_keys

DEFAULT_SERVED_NAME = "SmolLM2-135M-Instruct"


def register(app: typer.Typer) -> None:
    @app.command()
    @clean_errors
    @with_engine_flags()
    def serve(
        ctx: typer.Context,
        model: str = typer.Argument(None, help="Path, alias or Hub id (default: the embedded SmolLM2-135M)."),
        host: str = typer.Option("127.0.0.1", help="Interface to bind."),
        port: int = typer.Option(8000, min=0, max=65535, help="Port to bind."),
        max_queue: int = typer.Option(ServerConfig.max_queue, min=0,
                                      help="Sequences that may wait beyond --max-num-seqs; then 429."),
        api_key: str = typer.Option(None, envvar="RUVLLM_API_KEY",
                                    help="Require 'Authorization: Bearer KEY' on every route but /health."),
        api_keys: str = typer.Option(None, "--api-keys", metavar="FILE",
                                     help="Tenants' keys, `KEY TENANT` per line: a request is its key's tenant's "
                                          "(its own prefix cache; docs/learning.md)."),
        metrics_without_key: bool = typer.Option(False, "--metrics-without-key",
                                                 help="With --api-key: serve /metrics without the key."),
        route_without_key: list[str] = typer.Option([], "--route-without-key", metavar="PATH",
                                                    help="With --api-key: serve PATH without the key (repeatable)."),
        max_request_bytes: int = typer.Option(ServerConfig.max_request_bytes, "--max-request-bytes", min=1,
                                              help="Largest request body; a larger one gets 413."),
        drain_timeout: float = typer.Option(ServerConfig.graceful_shutdown_s, "--drain-timeout", min=0,
                                            help="Seconds in-flight requests get to finish after SIGINT/SIGTERM."),
        request_read_timeout: float = typer.Option(ServerConfig.request_read_timeout_s, "--request-read-timeout",
                                                   min=0.1, help="Seconds a request body may stall; then 408."),
        served_model_name: str = typer.Option(None, help="Model id clients send (default: MODEL as given)."),
        chat_template: str = typer.Option(None, help="Jinja chat template, or a path to one."),
        tool_parser: str = typer.Option(None, "--tool-parser", metavar="NAME",
                                        help="How tool calls are read from the model's text: hermes or "
                                             "llama3_json (default: from the chat template)."),
        cache_dir: str = typer.Option(None, help="Model cache (default: RUVLLM_CACHE_DIR or ~/.cache/ruvllm)."),
        lora: list[str] = typer.Option([], "--lora", metavar="NAME=PATH",
                                       help="Serve a PEFT LoRA adapter as model NAME (repeatable; enables LoRA)."),
        lora_dir: list[str] = typer.Option([], "--lora-dir", metavar="DIR",
                                           help="POST /v1/load_lora_adapter may read adapters under DIR (repeatable)."),
        allow_any_lora_path: bool = typer.Option(False, "--allow-any-lora-path",
                                                 help="POST /v1/load_lora_adapter may read adapters from any path."),
        witness_log: str = typer.Option(None, "--witness-log", metavar="PATH",
                                        help="The witness log of every completion (SQLite, hash-chained; default: "
                                             "$RUVLLM_DATA_DIR or ~/.local/share/ruvllm, witness.sqlite3; "
                                             "`off`: none)."),
        witness_store_tokens: bool = typer.Option(False, "--witness-store-tokens",
                                                  help="Keep prompt and output token ids in the witness log, not "
                                                       "only their hashes."),
        learn: bool = typer.Option(False, "--learn",
                                   help="Learn from POST /v1/feedback: each tenant's own adapter, updated per event "
                                        "(enables LoRA; docs/learning.md)."),
        feedback_rate: float = typer.Option(ServerConfig.feedback_rate, "--feedback-rate", min=0.001,
                                            help="With --learn: feedback events a second per tenant; then 429."),
        feedback_keep: int = typer.Option(LearningConfig.store_count, "--feedback-keep", min=1,
                                          help="With --learn: completions kept for feedback, at most."),
        feedback_max_age: float = typer.Option(LearningConfig.store_age_s, "--feedback-max-age", min=1,
                                               help="With --learn: seconds a completion takes feedback."),
        learn_nice: int = typer.Option(10, "--learn-nice", min=0, max=19, metavar="N",
                                       help="With --learn: the nice value of the threads that learn, so that "
                                            "updates take what serving leaves of the CPU (0: as serving)."),
        learned_dir: str = typer.Option(None, "--learned-dir", metavar="DIR",
                                        help="With --learn: where adapter versions are written (PEFT folders)."),
        deep_every: float = typer.Option(0.0, "--deep-every", min=0, metavar="WEIGHT",
                                         help="With --learn: run the deep loop (ruvllm learn run) for a tenant once "
                                              "its feedback since the last run weighs WEIGHT (the sum of |score|; a "
                                              "correction weighs 1; 0: never)."),
        deep_heldout: str = typer.Option(None, "--deep-heldout", metavar="FILE", help="The deep loop's held-out text."),
        deep_general: str = typer.Option(None, "--deep-general", metavar="FILE", help="The deep loop's everyday text."),
        deep_probes: str = typer.Option(None, "--deep-probes", metavar="FILE", help="The deep loop's probes (JSON lines)."),
        data_parallel_size: int = typer.Option(1, "--data-parallel-size", "--dp", min=1, metavar="N",
                                               help="Engine-core processes, each with its own model copy and KV "
                                                    "cache, behind this one server (docs/scaling.md)."),
        threads_per_replica: int = typer.Option(None, "--threads-per-replica", min=1, metavar="T",
                                                help="With --data-parallel-size: CPU threads of each replica "
                                                     "(default: the cores split evenly; --threads is ignored)."),
        routing: str = typer.Option("prefix", "--routing", metavar="POLICY",
                                    help="With --data-parallel-size: prefix (the replica that holds the prompt's "
                                         "prefix, under a load bound), least_loaded or round_robin."),
        engine: EngineFlags = None,  # type: ignore[assignment]  # the generated engine flags
    ) -> None:
        """Serve MODEL with an OpenAI-compatible API (chat, completions, models, metrics, SSE streaming).

        The engine core (model, scheduler, KV cache) runs in a child process of its own."""
        from ruvllm.engine.async_engine import AsyncEngine
        from ruvllm.engine.data_parallel import DataParallelConfig
        from ruvllm.engine.router import ROUTING_POLICIES, RouterConfig
        from ruvllm.device import check_device_name
        from ruvllm.loader.model_cache import resolve_cli_model
        from ruvllm.server.app import create_app
        from ruvllm.server.process import serve as serve_app

        state: CliState = ctx.obj
        console = state.console(stderr=True)
        template = chat_template
        if template and Path(template).is_file():
            template = Path(template).read_text(encoding="utf-8")
        check_device_name(engine.get("device") or "auto")  # a bad --device fails before any model is looked for
        check_port_free(host, port)  # before seconds of loading, not after
        keys = read_api_keys(api_keys) if api_keys else ()  # a bad file fails before the model loads
        if tool_parser:
            from ruvllm.tools.parsers import PARSERS  # the table the server reads

            if tool_parser not in PARSERS:
                raise fail(f"--tool-parser {tool_parser}: one of {', '.join(PARSERS)}")
        if deep_every and not (learn and deep_heldout):
            raise fail("--deep-every needs --learn and --deep-heldout FILE")
        for flag, value in (("--deep-heldout", deep_heldout), ("--deep-general", deep_general),
                            ("--deep-probes", deep_probes)):
            if value and not Path(value).is_file():
                raise fail(f"{flag} {value}: no such file")
        if routing not in ROUTING_POLICIES:
            raise fail(f"--routing {routing}: one of {', '.join(ROUTING_POLICIES)}")
        if data_parallel_size > 1 and learn:
            raise fail("--learn with --data-parallel-size > 1 is not supported: a tenant's learned adapter "
                       "lives in one engine")
        path = resolve_cli_model(model, cache_dir)
        adapters = [parse_lora_flag(spec) for spec in lora]
        overrides: dict = {"enable_lora": True} if adapters or learn else {}
        if learn:  # every learning tenant keeps two small versions loaded; they need no rank-64 slots
            if engine.get("max_cpu_loras") is None:
                overrides["max_cpu_loras"] = 1024
            if engine.get("max_lora_rank") is None and not adapters:
                overrides["max_lora_rank"] = 8
        with console.status("loading model"):
            async_engine = AsyncEngine(engine.to_config(path, **overrides), DataParallelConfig(
                data_parallel_size, threads_per_replica, routing=RouterConfig(policy=routing)))
        try:
            for name, adapter_path in adapters:
                async_engine.load_lora(name, adapter_path)
        except BaseException:
            async_engine.shutdown()
            raise
        info = async_engine.info
        open_routes = (*route_without_key, *(["/metrics"] if metrics_without_key else []))
        cfg = ServerConfig(host=host, port=port, api_key=api_key, routes_without_key=tuple(open_routes),
                           api_keys=keys,
                           max_request_bytes=max_request_bytes, request_read_timeout_s=request_read_timeout,
                           graceful_shutdown_s=drain_timeout, max_queue=max_queue, chat_template=template, tool_parser=tool_parser,
                           served_model_name=served_model_name or model or DEFAULT_SERVED_NAME,
                           lora_dirs=tuple(lora_dir), startup_lora_paths=tuple(p for _, p in adapters),
                           allow_any_lora_path=allow_any_lora_path,
                           witness_log=witness_path(witness_log), witness_store_tokens=witness_store_tokens,
                           learning=LearningConfig(store_count=feedback_keep, store_age_s=feedback_max_age,
                                                   root=learned_dir, threads=1, background_s=0.1, nice=learn_nice)
                           if learn else None,
                           feedback_rate=feedback_rate, deep_every=deep_every, deep_heldout=deep_heldout,
                           deep_general=deep_general, deep_probes=deep_probes)
        kv_mib = info.kv_cache_bytes / 2**20
        tiers = (f" ({info.num_hot_blocks} hot + {info.num_cold_blocks} {info.kv_cache_dtype} cold)"
                 if info.num_cold_blocks else "")
        replicas = f"{data_parallel_size} replicas, " if data_parallel_size > 1 else ""
        console.print(f"model [bold]{cfg.served_model_name}[/bold] ({info.model}), {replicas}"
                      f"{info.architecture}, context {info.max_seq_len}; KV cache "
                      f"{info.num_blocks} blocks{tiers} x {info.block_size} = {info.num_blocks * info.block_size:,} "
                      f"tokens ({kv_mib:.0f} MiB); {info.dtype} on {info.device}")
        app = create_app(async_engine, cfg, owns_engine=True)
        console.print(f"starting the server on http://{host}:{port}/v1  (Ctrl-C stops it)")
        try:
            started = serve_app(app, async_engine, host, port, cfg.graceful_shutdown_s)
        finally:
            async_engine.shutdown()
        if not started:
            raise fail(f"could not start the server on {host}:{port} (is the port in use?)")


def witness_path(flag: str | None) -> str | None:
    from ruvllm.witness.log import default_witness_path

    if flag == "off":
        return None
    return str(Path(flag).expanduser()) if flag else str(default_witness_path())


def parse_lora_flag(spec: str) -> tuple[str, str]:
    name, sep, path = spec.partition("=")
    if not sep or not name or not path:
        raise fail(f"--lora takes NAME=PATH, got {spec!r}")
    return name, path


def check_port_free(host: str, port: int) -> None:
    """Fail at once, with one line, when the port is taken: a bind test as uvicorn will bind."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as exc:
            raise fail(f"cannot listen on {host}:{port}: {exc.strerror or exc} (is the port in use?)") from None
