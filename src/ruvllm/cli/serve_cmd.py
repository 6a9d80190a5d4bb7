"""`ruvllm serve [MODEL]`: the OpenAI-compatible HTTP server."""

from __future__ import annotations

import socket
from pathlib import Path
from typing import Any

import typer

from ruvllm.cli.common import CliState, clean_errors, fail
from ruvllm.cli.engine_options import Flags, with_engine_flags, with_flags
from ruvllm.engine.data_parallel import DataParallelConfig
from ruvllm.engine.router import RouterConfig
from ruvllm.learning.config import LearningConfig
from ruvllm.server.config import ServerConfig
from ruvllm.server.tenants import read_api_keys

DEFAULT_SERVED_NAME = "SmolLM2-135M-Instruct"


def register(app: typer.Typer) -> None:
    @app.command()
    @clean_errors
    @with_engine_flags()
    @with_flags("dp", DataParallelConfig, RouterConfig)
    @with_flags("learning", LearningConfig)
    @with_flags("server", ServerConfig, defaults={"served_model_name": None})
    def serve(
        ctx: typer.Context,
        model: str = typer.Argument(None, help="Path, alias or Hub id (default: the embedded SmolLM2-135M)."),
        api_keys: str = typer.Option(None, "--api-keys", metavar="FILE",
                                     help="Tenants' keys, `KEY TENANT` per line: a request is its key's tenant's "
                                          "(its own prefix cache; docs/learning.md)."),
        metrics_without_key: bool = typer.Option(False, "--metrics-without-key",
                                                 help="With --api-key: serve /metrics without the key."),
        cache_dir: str = typer.Option(None, help="Model cache (default: RUVLLM_CACHE_DIR or ~/.cache/ruvllm)."),
        lora: list[str] = typer.Option([], "--lora", metavar="NAME=PATH",
                                       help="Serve a PEFT LoRA adapter as model NAME (repeatable; enables LoRA)."),
        model_specs: list[str] = typer.Option([], "--model", metavar="NAME=SOURCE",
                                              help="Serve model SOURCE (a path, an alias or a Hub id) as NAME, beside "
                                                   "the others (repeatable): each loads on its first request and "
                                                   "unloads when idle (--keep-alive, --max-memory, --preload)."),
        models_file: str = typer.Option(None, "--models-file", metavar="FILE",
                                        help="Models to serve, `NAME=SOURCE` per line (as --model)."),
        learn: bool = typer.Option(False, "--learn",
                                   help="Learn from POST /v1/feedback: each tenant's own adapter, updated per event "
                                        "(enables LoRA; docs/learning.md)."),
        # the generated flags, one group each
        engine: Flags = None, server: Flags = None, learning: Flags = None, dp: Flags = None,  # type: ignore[assignment]
    ) -> None:
        """Serve MODEL with an OpenAI-compatible API (chat, completions, models, metrics, SSE streaming).

        The engine core (model, scheduler, KV cache) runs in a child process of its own."""
        from ruvllm.gc_settings import defer_collection

        defer_collection()  # until the server starts: gc_settings.py
        from ruvllm.engine.async_engine import AsyncEngine
        from ruvllm.device import check_device_name
        from ruvllm.loader.model_cache import resolve_cli_model

        state: CliState = ctx.obj
        console = state.console(stderr=True)
        check_device_name(engine.get("device") or "auto")  # a bad --device fails before any model is looked for
        adapters = [parse_lora_flag(spec) for spec in lora]
        cfg = server.make(ServerConfig, served_model_name=server.get("served_model_name") or model or DEFAULT_SERVED_NAME,
                          chat_template=read_template(server.get("chat_template")),
                          api_keys=read_api_keys(api_keys) if api_keys else (),  # a bad file fails before loading
                          routes_without_key=(*server.get("routes_without_key"),
                                              *(["/metrics"] if metrics_without_key else [])),
                          startup_lora_paths=tuple(p for _, p in adapters),
                          witness_log=witness_path(server.get("witness_log")),
                          learning=learning.make(LearningConfig, threads=1, background_s=0.1) if learn else None)
        host, port = cfg.host, cfg.port
        check_port_free(host, port)  # before seconds of loading, not after
        if cfg.grpc_port:
            check_port_free(host, cfg.grpc_port)
        if cfg.deep_every and not (learn and cfg.deep_heldout):
            raise fail("--deep-every needs --learn and --deep-heldout FILE")
        for flag, value in (("--deep-heldout", cfg.deep_heldout), ("--deep-general", cfg.deep_general),
                            ("--deep-probes", cfg.deep_probes)):
            if value and not Path(value).is_file():
                raise fail(f"{flag} {value}: no such file")
        replicas = dp.make(DataParallelConfig, routing=dp.make(RouterConfig))
        if replicas.size > 1 and learn:
            raise fail("--learn with --data-parallel-size > 1 is not supported: a tenant's learned adapter "
                       "lives in one engine")
        if model_specs or models_file:
            if model or adapters or learn or replicas.size > 1:
                raise fail("--model NAME=SOURCE / --models-file serve several models; give no MODEL argument, "
                           "--lora, --learn or --data-parallel-size with them")
            serve_many(console, engine, cfg, model_specs, models_file, cache_dir)
            return
        path = resolve_cli_model(model, cache_dir)
        # The model's files checked from their headers (milliseconds; the launch checks them again) before
        # the server's modules and the core process: a broken model fails without paying for either.
        from ruvllm.loader import load_model_config, resolve_model

        load_model_config(resolve_model(path))
        # The server's modules (transformers among their imports: seconds of CPU) only once the flags,
        # the port and the model are known good: a mistake in any of them is one line in a fraction of a second.
        from ruvllm.gc_settings import startup_done
        from ruvllm.server.app import create_app
        from ruvllm.server.process import serve as serve_app

        overrides: dict = {"enable_lora": True} if adapters or learn else {}
        if learn:  # every learning tenant keeps two small versions loaded; they need no rank-64 slots
            if engine.get("max_cpu_loras") is None:
                overrides["max_cpu_loras"] = 1024
            if engine.get("max_lora_rank") is None and not adapters:
                overrides["max_lora_rank"] = 8
        with console.status("loading model"):
            async_engine = AsyncEngine.launch(engine.to_config(path, **overrides), replicas)
        try:
            for name, adapter_path in adapters:
                async_engine.load_lora(name, adapter_path)
        except BaseException:
            async_engine.shutdown()
            raise
        info = async_engine.info
        kv_mib = info.kv_cache_bytes / 2**20
        tiers = (f" ({info.num_hot_blocks} hot + {info.num_cold_blocks} {info.kv_cache_dtype} cold)"
                 if info.num_cold_blocks else "")
        replicas_text = f"{replicas.size} replicas, " if replicas.size > 1 else ""
        console.print(f"model [bold]{cfg.served_model_name}[/bold] ({info.model}), {replicas_text}"
                      f"{info.architecture}, context {info.max_seq_len}; KV cache "
                      f"{info.num_blocks} blocks{tiers} x {info.block_size} = {info.num_blocks * info.block_size:,} "
                      f"tokens ({kv_mib:.0f} MiB); {info.dtype} on {info.device}")
        app = create_app(async_engine, cfg, owns_engine=True)
        grpc_text = f" and gRPC on {host}:{cfg.grpc_port}" if cfg.grpc_port is not None else ""
        console.print(f"starting the server on http://{host}:{port}/v1{grpc_text}  (Ctrl-C stops it)")
        startup_done()
        try:
            started = serve_app(app, async_engine, host, port, cfg.graceful_shutdown_s)
        finally:
            async_engine.shutdown()
        if not started:
            raise fail(f"could not start the server on {host}:{port} (is the port in use?)")


def serve_many(console: Any, engine: Flags, cfg: ServerConfig, specs: list[str], models_file: str | None,
               cache_dir: str | None) -> None:
    """Several models behind one server (server/model_pool.py): nothing loads here but --preload's."""
    from dataclasses import replace

    from ruvllm.gc_settings import startup_done
    from ruvllm.loader.model_cache import resolve_cli_model
    from ruvllm.server.app import create_pool_app
    from ruvllm.server.model_pool import FOREVER, PoolSettings, parse_model_spec, read_models_file
    from ruvllm.server.process import serve as serve_app

    try:
        named = [parse_model_spec(spec) for spec in specs] + (read_models_file(models_file) if models_file else [])
    except (ValueError, OSError) as exc:
        raise fail(str(exc)) from None
    names = [name for name, _ in named]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise fail(f"model name {twice[0]!r} is given twice")
    configs = {name: engine.to_config(resolve_cli_model(source, cache_dir)) for name, source in named}
    cfg = replace(cfg, served_model_name=names[0])
    settings = PoolSettings(keep_alive_s=FOREVER if cfg.keep_alive_s < 0 else cfg.keep_alive_s,
                            max_memory_bytes=None if cfg.max_memory_gib is None else int(cfg.max_memory_gib * 2**30))
    try:
        app = create_pool_app(configs, cfg, settings, preload=cfg.preload)
    except ValueError as exc:
        raise fail(str(exc)) from None
    keep = "for ever" if settings.keep_alive_s == FOREVER else f"{settings.keep_alive_s:g} s idle"
    budget = f", at most {cfg.max_memory_gib:g} GiB loaded" if cfg.max_memory_gib is not None else ""
    console.print(f"models {', '.join(f'[bold]{n}[/bold]' for n in names)}: each loads on its first request and "
                  f"stays {keep}{budget}")
    console.print(f"starting the server on http://{cfg.host}:{cfg.port}/v1  (Ctrl-C stops it)")
    startup_done()
    if not serve_app(app, app.state.models, cfg.host, cfg.port, cfg.graceful_shutdown_s):
        raise fail(f"could not start the server on {cfg.host}:{cfg.port} (is the port in use?)")


def read_template(value: str | None) -> str | None:
    """--chat-template: the template, or a path to one."""
    return Path(value).read_text(encoding="utf-8") if value and Path(value).is_file() else value


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
