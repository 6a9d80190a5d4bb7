"""One Ray Serve replica of the engine: an engine core in a process of its own (ProcessCoreClient,
as under `ruvllm serve`), reached by the front through a DeploymentHandle.

`generate(requests)` streams the core's deltas for one request's sequences as batches of
(outputs, stats, replica id); leaving the stream early (the front cancels it) aborts them in the
core. `abort(ids, target=...)` reaches this very replica through the request router's target hint
(engine/ray_serve/request_router.py), for one of n sequences ended by a stop string. Ray Serve
restarts a replica whose actor dies, and `check_health` fails when the core has, so Serve restarts
that one too.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from ruvllm.config import EngineConfig
from ruvllm.engine.async_engine import Stream, deliver
from ruvllm.engine.core_client import ProcessCoreClient
from ruvllm.errors import EngineDeadError
from ruvllm.messages import CoreOutput, CoreRequest, EngineInfo, EngineStats, GetStats

Batch = tuple[list[CoreOutput], EngineStats, str]


@dataclass
class _Stream(Stream):
    """A request's sequences' stream, and which of them are still open."""

    open: set[str] = field(default_factory=set)


class EngineReplica:
    """The class Ray Serve deploys (ray_serve/app.py wraps it with serve.deployment)."""

    def __init__(self, config: EngineConfig) -> None:
        self.client = ProcessCoreClient(config)
        self.client.wait_ready()
        self._lock = threading.Lock()
        self._streams: dict[str, _Stream] = {}  # sequence id -> its request's stream
        self._failure: EngineDeadError | None = None
        self.client.start(self._on_outputs, self._on_failure)
        try:
            from ray import serve

            self.replica_id = serve.get_replica_context().replica_id.to_full_id_str()
        except Exception:  # constructed outside Serve (tests of the class itself)
            self.replica_id = "local"

    async def info(self) -> EngineInfo:
        return self.client.info

    async def generate(self, requests: list[CoreRequest]) -> AsyncIterator[Batch]:
        stream = _Stream(asyncio.get_running_loop(), open={r.request_id for r in requests})
        with self._lock:
            if self._failure is not None:
                raise self._failure
            for sid in stream.open:
                self._streams[sid] = stream
        try:
            self.client.add(requests)
            yield [], self.client.latest_stats, self.replica_id  # where it runs, at once (for targeted aborts)
            while stream.open:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    raise item
                for out in item:
                    if out.finish_reason is not None:
                        stream.open.discard(out.request_id)
                yield item, self.client.latest_stats, self.replica_id
        finally:
            with self._lock:
                for sid in requests:
                    self._streams.pop(sid.request_id, None)
                left = sorted(stream.open)
            if left:  # the front left early (cancelled: a client went away) or the core failed
                self.client.abort(left)

    async def abort(self, request_ids: list[str], target: str | None = None) -> None:
        """Abort sequences running here (`target` is read by the request router, not here)."""
        with self._lock:
            for sid in request_ids:
                stream = self._streams.pop(sid, None)
                if stream is not None:
                    stream.open.discard(sid)
        self.client.abort(request_ids)

    async def stats(self) -> EngineStats:
        return self.client.call(GetStats()).stats

    def record_routing_stats(self) -> dict[str, float]:
        """Ray Serve polls this for the request router (kv_usage orders equally loaded replicas)."""
        s = self.client.latest_stats
        return {"running": s.running, "waiting": s.waiting, "kv_usage": s.kv_usage}

    def check_health(self) -> None:
        """Ray Serve calls this periodically; raising makes it replace the replica."""
        if self._failure is not None or not self.client.is_alive:
            raise RuntimeError(f"the engine core is not running: {self._failure}")

    def __del__(self) -> None:
        client = getattr(self, "client", None)
        if client is not None:
            client.shutdown()

    # --- the core client's receiving thread -----------------------------------------------------------
    def _on_outputs(self, outputs: list[CoreOutput]) -> None:
        by_stream: dict[int, tuple[_Stream, list[CoreOutput]]] = {}
        with self._lock:
            for out in outputs:
                stream = self._streams.get(out.request_id)
                if stream is not None:
                    by_stream.setdefault(id(stream), (stream, []))[1].append(out)
        for stream, outs in by_stream.values():
            deliver(stream, outs)

    def _on_failure(self, error: EngineDeadError) -> None:
        with self._lock:
            self._failure = error
            streams = {id(s): s for s in self._streams.values()}
            self._streams.clear()
        for stream in streams.values():
            deliver(stream, error)
