"""`ruvllm serve [MODEL]`: the OpenAI-compatible HTTP server."""

from __future__ import annotations

from pathlib import Path

import typer

from ruvllm.cli.common import CliState, clean_errors, fail
from ruvllm.cli.engine_options import DEVICE_HELP, KV_CACHE_DTYPE_HELP, KV_HOT_TOKENS_HELP, QUANTIZATION_HELP
from ruvllm.config import CacheConfig
from ruvllm.server.config import ServerConfig

DEFAULT_SERVED_NAME = "SmolLM2-135M-Instruct"


def register(app: typer.Typer) -> None:
    @app.command()
    @clean_errors
    def serve(
        ctx: typer.Context,
        model: str = typer.Argument(None, help="Path, alias or Hub id (default: the embedded SmolLM2-135M)."),
        host: str = typer.Option("127.0.0.1", help="Interface to bind."),
        port: int = typer.Option(8000, min=0, max=65535, help="Port to bind."),
        max_concurrent: int = typer.Option(32, min=1, help="Sequences running at once."),
        max_queue: int = typer.Option(256, min=0, help="Sequences that may wait beyond those; then 429."),
        api_key: str = typer.Option(None, envvar="RUVLLM_API_KEY",
                                    help="Require 'Authorization: Bearer KEY' on every route but /health."),
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
        cache_dir: str = typer.Option(None, help="Model cache (default: RUVLLM_CACHE_DIR or ~/.cache/ruvllm)."),
        dtype: str = typer.Option("auto", help="auto (bf16 where the CPU has native bf16, else float32), float32, bfloat16, float16."),
        max_context: int = typer.Option(None, "--max-context", min=1, help="Context length cap."),
        block_size: int = typer.Option(16, min=1, help="Tokens per KV-cache block."),
        kv_cache_gib: float = typer.Option(None, "--kv-cache-gib", min=0.001,
                                           help="KV-cache memory budget (default: 1 GiB on CPU; on CUDA what "
                                                "--gpu-memory-utilization leaves after a profiled warm-up)."),
        num_blocks: int = typer.Option(None, min=1, help="KV blocks (overrides --kv-cache-gib)."),
        max_num_batched_tokens: int = typer.Option(512, min=1, help="Token budget of one engine step."),
        no_prefix_caching: bool = typer.Option(False, "--no-prefix-caching", help="Disable prefix caching."),
        threads: int = typer.Option(None, min=1, help="Intra-op threads (default: all cores)."),
        quantization: str = typer.Option("auto", "--quantization", "-q", help=QUANTIZATION_HELP),
        group_size: int = typer.Option(32, "--group-size", help="Inputs per int4 quantization group (32, 64, 128, 256)."),
        device: str = typer.Option("auto", "--device", help=DEVICE_HELP),
        gpu_memory_utilization: float = typer.Option(0.9, "--gpu-memory-utilization", min=0.01, max=1.0,
                                                     help="Share of the GPU's memory the engine may use (CUDA)."),
        kv_cache_dtype: str = typer.Option("auto", "--kv-cache-dtype", help=KV_CACHE_DTYPE_HELP),
        kv_hot_tokens: int = typer.Option(CacheConfig.kv_hot_tokens, "--kv-hot-tokens", help=KV_HOT_TOKENS_HELP),
    ) -> None:
        """Serve MODEL with an OpenAI-compatible API (chat, completions, models, metrics, SSE streaming)."""
        from ruvllm.cli.engine_options import EngineOptions
        from ruvllm.engine.async_engine import AsyncEngine
        from ruvllm.device import resolve_device
        from ruvllm.loader.hub import resolve_cli_model
        from ruvllm.server.app import create_app
        from ruvllm.server.process import serve as serve_app

        state: CliState = ctx.obj
        console = state.console(stderr=True)
        template = chat_template
        if template and Path(template).is_file():
            template = Path(template).read_text(encoding="utf-8")
        opts = EngineOptions(dtype, max_context, block_size, kv_cache_gib, num_blocks, max_num_batched_tokens,
                             no_prefix_caching, threads, quantization, group_size, device, gpu_memory_utilization,
                             kv_cache_dtype=kv_cache_dtype, kv_hot_tokens=kv_hot_tokens)
        resolve_device(device)  # a bad --device fails before any model is looked for
        path = resolve_cli_model(model, cache_dir)
        with console.status("loading model"):
            engine = AsyncEngine(opts.to_config(path, max_concurrent))
        core = engine.core
        open_routes = (*route_without_key, *(["/metrics"] if metrics_without_key else []))
        cfg = ServerConfig(host=host, port=port, api_key=api_key, routes_without_key=tuple(open_routes),
                           max_request_bytes=max_request_bytes, request_read_timeout_s=request_read_timeout,
                           graceful_shutdown_s=drain_timeout,
                           max_concurrent=max_concurrent,
                           max_queue=max_queue, chat_template=template,
                           served_model_name=served_model_name or model or DEFAULT_SERVED_NAME)
        kv_mib = core.runner.kv_cache_bytes / 2**20
        pool = core.kv.pool
        tiers = f" ({pool.num_hot} hot + {pool.num_cold} {kv_cache_dtype} cold)" if pool.num_cold else ""
        console.print(f"model [bold]{cfg.served_model_name}[/bold] ({core.model_path}), "
                      f"{core.model_config.architecture}, context {core.max_seq_len}; KV cache "
                      f"{core.num_blocks} blocks{tiers} x {block_size} = {core.num_blocks * block_size:,} tokens "
                      f"({kv_mib:.0f} MiB)")
        app = create_app(engine, cfg, owns_engine=True)
        console.print(f"starting the server on http://{host}:{port}/v1  (Ctrl-C stops it)")
        try:
            started = serve_app(app, engine, host, port, cfg.graceful_shutdown_s)
        finally:
            engine.shutdown()
        if not started:
            raise fail(f"could not start the server on {host}:{port} (is the port in use?)")
