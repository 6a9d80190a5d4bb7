"""The Ray Serve application (docs/scaling.md, "Ray Serve"): `ruvllm ray-serve`, or `serve run
ruvllm.ray_serve.app:build_app model=PATH replicas=2` with Ray's own CLI.

Two deployments:
- `RuvllmEngine` (ray_serve/engine_replica.py): N replicas, each an engine core in a process of its
  own, one CPU bundle each (`cpus_per_replica`), placed by Ray on any node of the cluster; calls
  reach them through ruvllm's request router (ray_serve/request_router.py). Autoscaling, when
  asked, is Ray's own, on ongoing requests per replica (the queue depth the front keeps there).
- `RuvllmFront`: the OpenAI-compatible app of `ruvllm serve` (server/app.py's create_app over an
  AsyncEngine whose CoreClient is the handle to `RuvllmEngine`), mounted on Ray Serve's HTTP proxy.
"""

from __future__ import annotations

from typing import Any

from ray import serve
from ray.serve.config import RequestRouterConfig

from ruvllm.engine.router import RouterConfig
from ruvllm.ray_serve.engine_replica import EngineReplica
from ruvllm.server.config import RayServeConfig, ServerConfig


def engine_options(config: RayServeConfig, block_size: int) -> dict[str, Any]:
    """serve.deployment options of the engine replicas."""
    opts: dict[str, Any] = {
        "name": "RuvllmEngine",
        "ray_actor_options": {"num_cpus": config.cpus_per_replica},
        "max_ongoing_requests": config.max_ongoing_requests,
        "health_check_period_s": 2.0,
        "request_router_config": RequestRouterConfig(
            request_router_class="ruvllm.ray_serve.request_router:RuvllmRequestRouter",
            request_router_kwargs={"block_size": block_size, "policy": config.routing.policy,
                                   "load_factor": config.routing.load_factor},
            request_routing_stats_period_s=1.0),
    }
    if config.min_replicas is not None:
        opts["autoscaling_config"] = {"min_replicas": config.min_replicas, "max_replicas": config.max_replicas,
                                      "initial_replicas": max(config.min_replicas, 1),
                                      "target_ongoing_requests": config.target_ongoing_requests}
    else:
        opts["num_replicas"] = config.replicas
    return opts


@serve.ingress()
class RuvllmFront:
    """The OpenAI routes of `ruvllm serve` over the engine replicas' handle."""

    def __init__(self, engine: Any, config: RayServeConfig) -> None:
        self._handle, self._config = engine, config

    async def __serve_build_asgi_app__(self) -> Any:
        import asyncio

        from ruvllm.engine.async_engine import AsyncEngine
        from ruvllm.loader import load_tokenizer, resolve_model
        from ruvllm.ray_serve.core_client import RayCoreClient
        from ruvllm.server.app import create_app

        info = await self._handle.info.remote()
        tokenizer = await asyncio.to_thread(load_tokenizer, resolve_model(self._config.engine.model))
        engine = AsyncEngine(RayCoreClient(self._handle, info), tokenizer)
        return create_app(engine, self._config.server, owns_engine=True)


def application(config: RayServeConfig) -> Any:
    """The bound application: `serve.run(application(cfg), route_prefix="/")`."""
    block_size = config.engine.cache.block_size
    engine = serve.deployment(EngineReplica).options(**engine_options(config, block_size)).bind(config.engine)
    front = serve.deployment(RuvllmFront).options(name="RuvllmFront", ray_actor_options={"num_cpus": 0},
                                                  max_ongoing_requests=10_000)
    return front.bind(engine, config)


def build_app(args: dict[str, str]) -> Any:
    """For Ray's CLI: `serve run ruvllm.ray_serve.app:build_app model=PATH replicas=2 [min_replicas=1
    max_replicas=4 target_ongoing_requests=16] [threads=1] [name=SERVED_NAME]`: any setting of the
    engine, the server, the router or RayServeConfig, by its field's or its flag's name, as
    `ruvllm ray-serve` takes it (cli/engine_options.py)."""
    from ruvllm.cli.engine_options import ENGINE_CONFIGS, from_strings

    settings = {"served_model_name" if k == "name" else k: v for k, v in args.items() if k != "model"}
    flags = from_strings(settings, engine=ENGINE_CONFIGS, server=(ServerConfig,), ray=(RayServeConfig, RouterConfig))
    cfg = flags["ray"].make(RayServeConfig, engine=flags["engine"].to_config(args.get("model")),
                            server=flags["server"].make(ServerConfig), routing=flags["ray"].make(RouterConfig))
    return application(cfg)
