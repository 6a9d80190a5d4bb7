"""`ruvllm ray-serve [MODEL]`: the OpenAI-compatible server as a Ray Serve application, its engine
replicas spread over a Ray cluster (docs/scaling.md, "Ray Serve")."""

from __future__ import annotations

import signal
import threading

import typer

from ruvllm.cli.common import CliState, clean_errors, fail
from ruvllm.cli.engine_options import EngineFlags, with_engine_flags
from ruvllm.cli.serve_cmd import DEFAULT_SERVED_NAME
from ruvllm.server.config import ServerConfig


def register(app: typer.Typer) -> None:
    @app.command("ray-serve")
    @clean_errors
    @with_engine_flags()
    def ray_serve(
        ctx: typer.Context,
        model: str = typer.Argument(None, help="Path, alias or Hub id (default: the embedded SmolLM2-135M); "
                                               "every node must reach the same path."),
        replicas: int = typer.Option(1, "--replicas", min=1, help="Engine replicas (without autoscaling)."),
        min_replicas: int = typer.Option(None, "--min-replicas", min=0,
                                         help="Autoscale between --min-replicas and --max-replicas on ongoing "
                                              "requests per replica (Ray Serve's autoscaler)."),
        max_replicas: int = typer.Option(None, "--max-replicas", min=1, help="With --min-replicas."),
        target_ongoing_requests: float = typer.Option(16.0, "--target-ongoing-requests", min=0.1,
                                                      help="With autoscaling: the queue depth per replica aimed at."),
        cpus_per_replica: float = typer.Option(1.0, "--cpus-per-replica", min=0.1,
                                               help="CPUs Ray reserves for each engine replica (set --threads to "
                                                    "match)."),
        routing: str = typer.Option("prefix", "--routing", metavar="POLICY",
                                    help="prefix (the replica that holds the prompt's prefix, under a load bound), "
                                         "least_loaded or round_robin."),
        address: str = typer.Option(None, "--address",
                                    help="The Ray cluster to join (`auto`: the one `ray start` runs here); "
                                         "default: start a local one."),
        host: str = typer.Option("127.0.0.1", help="Interface of Ray Serve's HTTP proxy."),
        port: int = typer.Option(8000, min=0, max=65535, help="Port of Ray Serve's HTTP proxy."),
        served_model_name: str = typer.Option(None, help="Model id clients send (default: MODEL as given)."),
        api_key: str = typer.Option(None, envvar="RUVLLM_API_KEY",
                                    help="Require 'Authorization: Bearer KEY' on every route but /health."),
        chat_template: str = typer.Option(None, help="Jinja chat template, or a path to one."),
        engine: EngineFlags = None,  # type: ignore[assignment]  # the generated engine flags
    ) -> None:
        """Serve MODEL on Ray Serve: engine replicas placed on the cluster's nodes, the OpenAI routes on
        Ray Serve's HTTP proxy, prefix-aware routing, Ray's autoscaling. Ctrl-C removes the application."""
        from pathlib import Path

        from ruvllm.engine.router import ROUTING_POLICIES
        from ruvllm.loader.model_cache import resolve_cli_model

        state: CliState = ctx.obj
        console = state.console(stderr=True)
        if routing not in ROUTING_POLICIES:
            raise fail(f"--routing {routing}: one of {', '.join(ROUTING_POLICIES)}")
        if (min_replicas is None) != (max_replicas is None):
            raise fail("autoscaling needs both --min-replicas and --max-replicas")
        try:
            import ray
            from ray import serve
        except ImportError:
            raise fail("Ray Serve is not installed: pip install 'ray[serve]'") from None
        from ruvllm.ray_serve.app import RayServeConfig, application

        template = chat_template
        if template and Path(template).is_file():
            template = Path(template).read_text(encoding="utf-8")
        path = resolve_cli_model(model, None)
        cfg = RayServeConfig(engine=engine.to_config(path),
                             server=ServerConfig(host=host, port=port, api_key=api_key, chat_template=template,
                                                 served_model_name=served_model_name or model or DEFAULT_SERVED_NAME),
                             replicas=replicas, min_replicas=min_replicas, max_replicas=max_replicas,
                             target_ongoing_requests=target_ongoing_requests, cpus_per_replica=cpus_per_replica,
                             routing=routing)
        with console.status("starting Ray and the replicas"):
            ray.init(address=address, logging_level="WARNING", log_to_driver=False)
            serve.start(http_options={"host": host, "port": port})
            serve.run(application(cfg), name="ruvllm", route_prefix="/")
        console.print(f"serving [bold]{cfg.server.served_model_name}[/bold] on http://{host}:{port}/v1 through Ray "
                      f"Serve ({'autoscaling' if min_replicas is not None else replicas} engine replica(s); "
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
