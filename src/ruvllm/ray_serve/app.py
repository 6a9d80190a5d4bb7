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

from dataclasses import dataclass, field
from typing import Any

from ray import serve
from ray.serve.config import RequestRouterConfig

from ruvllm.config import EngineConfig
from ruvllm.ray_serve.engine_replica import EngineReplica
from ruvllm.server.config import ServerConfig


@dataclass(frozen=True)
class RayServeConfig:
    engine: EngineConfig = field(default_factory=EngineConfig)
    server: ServerConfig = field(default_factory=ServerConfig)
    replicas: int = 1  # fixed count, unless autoscaling is given
    min_replicas: int | None = None  # autoscaling: Ray Serve's own, on ongoing requests per replica
    max_replicas: int | None = None
    target_ongoing_requests: float = 16.0
    cpus_per_replica: float = 1.0
    max_ongoing_requests: int = 256  # per engine replica: Serve holds more back (its own queue)
    routing: str = "prefix"
    load_factor: float = 1.25

    def __post_init__(self) -> None:
        if self.replicas < 1:
            raise ValueError(f"replicas must be at least 1, got {self.replicas}")
        if (self.min_replicas is None) != (self.max_replicas is None):
            raise ValueError("autoscaling needs both min_replicas and max_replicas")
        if self.min_replicas is not None and not 0 <= self.min_replicas <= self.max_replicas:  # type: ignore[operator]
            raise ValueError(f"min_replicas ({self.min_replicas}) must be between 0 and max_replicas "
                             f"({self.max_replicas})")

    def engine_options(self, block_size: int) -> dict[str, Any]:
        """serve.deployment options of the engine replicas."""
        opts: dict[str, Any] = {
            "name": "RuvllmEngine",
            "ray_actor_options": {"num_cpus": self.cpus_per_replica},
            "max_ongoing_requests": self.max_ongoing_requests,
            "health_check_period_s": 2.0,
            "request_router_config": RequestRouterConfig(
                request_router_class="ruvllm.ray_serve.request_router:RuvllmRequestRouter",
                request_router_kwargs={"block_size": block_size, "policy": self.routing,
                                       "load_factor": self.load_factor},
                request_routing_stats_period_s=1.0),
        }
        if self.min_replicas is not None:
            opts["autoscaling_config"] = {"min_replicas": self.min_replicas, "max_replicas": self.max_replicas,
                                          "initial_replicas": max(self.min_replicas, 1),
                                          "target_ongoing_requests": self.target_ongoing_requests}
        else:
            opts["num_replicas"] = self.replicas
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
        engine = AsyncEngine.over(RayCoreClient(self._handle, info), tokenizer)
        return create_app(engine, self._config.server, owns_engine=True)


def application(config: RayServeConfig) -> Any:
    """The bound application: `serve.run(application(cfg), route_prefix="/")`."""
    block_size = config.engine.cache.block_size
    engine = serve.deployment(EngineReplica).options(**config.engine_options(block_size)).bind(config.engine)
    front = serve.deployment(RuvllmFront).options(name="RuvllmFront", ray_actor_options={"num_cpus": 0},
                                                  max_ongoing_requests=10_000)
    return front.bind(engine, config)


def build_app(args: dict[str, str]) -> Any:
    """For Ray's CLI: `serve run ruvllm.ray_serve.app:build_app model=PATH replicas=2 [min_replicas=1
    max_replicas=4 target_ongoing_requests=16] [threads=1] [name=SERVED_NAME]`."""
    engine = EngineConfig(model=args.get("model"), num_threads=int(args["threads"]) if "threads" in args else None)
    cfg = RayServeConfig(engine=engine, server=ServerConfig(served_model_name=args.get("name", "default")),
                         replicas=int(args.get("replicas", 1)),
                         min_replicas=int(args["min_replicas"]) if "min_replicas" in args else None,
                         max_replicas=int(args["max_replicas"]) if "max_replicas" in args else None,
                         target_ongoing_requests=float(args.get("target_ongoing_requests", 16)),
                         routing=args.get("routing", "prefix"))
    return application(cfg)
