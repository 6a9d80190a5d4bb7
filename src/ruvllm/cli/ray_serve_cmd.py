"""`ruvllm ray-serve [MODEL]`: the OpenAI-compatible server as a Ray Serve application, its engine
replicas spread over a Ray cluster (docs/scaling.md, "Ray Serve")."""

from __future__ import annotations

import signal
import threading

import typer

from ruvllm.cli.common import CliState, clean_errors, fail
from ruvllm.cli.engine_options import Flags, with_engine_flags, with_flags
from ruvllm.cli.serve_cmd import DEFAULT_SERVED_NAME, read_template
from ruvllm.engine.router import RouterConfig
from ruvllm.server.config import RayServeConfig, ServerConfig


def register(app: typer.Typer) -> None:
    @app.command("ray-serve")
    @clean_errors
    @with_engine_flags()
    @with_flags("deploy", RayServeConfig, RouterConfig)
    @with_flags("server", ServerConfig, only=("host", "port", "served_model_name", "api_key", "chat_template"),
                defaults={"served_model_name": None})
    def ray_serve(
        ctx: typer.Context,
        model: str = typer.Argument(None, help="Path, alias or Hub id (default: the embedded SmolLM2-135M); "
                                               "every node must reach the same path."),
        address: str = typer.Option(None, "--address",
                                    help="The Ray cluster to join (`auto`: the one `ray start` runs here); "
                                         "default: start a local one."),
        # the generated flags, one group each
        engine: Flags = None, server: Flags = None, deploy: Flags = None,  # type: ignore[assignment]
    ) -> None:
        """Serve MODEL on Ray Serve: engine replicas placed on the cluster's nodes, the OpenAI routes on
        Ray Serve's HTTP proxy, prefix-aware routing, Ray's autoscaling. Ctrl-C removes the application."""
        from ruvllm.loader.model_cache import resolve_cli_model

        state: CliState = ctx.obj
        console = state.console(stderr=True)
        cfg = deploy.make(RayServeConfig, engine=engine.to_config(resolve_cli_model(model, None)),
                          routing=deploy.make(RouterConfig),
                          server=server.make(ServerConfig, chat_template=read_template(server.get("chat_template")),
                                             served_model_name=server.get("served_model_name") or model
                                             or DEFAULT_SERVED_NAME))
        try:
            import ray
            from ray import serve
        except ImportError:
            raise fail("Ray Serve is not installed: pip install 'ray[serve]'") from None
        from ruvllm.ray_serve.app import application

        host, port = cfg.server.host, cfg.server.port
        with console.status("starting Ray and the replicas"):
            ray.init(address=address, logging_level="WARNING", log_to_driver=False)
            serve.start(http_options={"host": host, "port": port,
                                      "keep_alive_timeout_s": cfg.server.http_keep_alive_s})
            serve.run(application(cfg), name="ruvllm", route_prefix="/")
        console.print(f"serving [bold]{cfg.server.served_model_name}[/bold] on http://{host}:{port}/v1 through Ray "
                      f"Serve ({'autoscaling' if cfg.min_replicas is not None else cfg.replicas} engine replica(s); "
                      f"Ctrl-C stops it)")
        stop = threading.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: stop.set())
        while not stop.wait(1.0):
            pass
        console.print("removing the application")
        serve.delete("ruvllm")
        serve.shutdown()
        ray.shutdown()
