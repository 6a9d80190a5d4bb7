"""The front's CoreClient over a Ray Serve DeploymentHandle to the engine replicas.

With it, the Ray deployment's front is AsyncEngine and create_app, the very code `ruvllm serve`
runs: only where the core lives differs. Each request's sequences go out as one streaming call
(`EngineReplica.generate`), which the deployment's request router sends to a replica; the batches
that come back are handed to the front as a core's outputs are. A stream that breaks because its
replica died fails only its own sequences (ReplicaLostError: 503 at the server); Ray Serve starts a
new replica. Every method runs on the front's event loop (the one serving the HTTP request).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import Any

from ruvllm.engine.core_client import OnFailure, OnLost, OnOutputs, ReplicaState
from ruvllm.errors import ReplicaLostError
from ruvllm.messages import CallResult, CoreCall, CoreRequest, EngineInfo, EngineStats, GetStats, sum_stats

log = logging.getLogger(__name__)


@dataclass
class _Call:
    """One request's sequences on one replica (a streaming call)."""

    stream: Any  # DeploymentResponseGenerator
    open: set[str]
    replica: str | None = None  # known from the stream's first batch
    pending_aborts: list[str] = field(default_factory=list)


class RayCoreClient:
    def __init__(self, handle: Any, info: EngineInfo) -> None:
        self._handle = handle
        self.info = info
        self._calls: dict[str, _Call] = {}  # sequence id -> its call
        self._stats: dict[str, EngineStats] = {}  # replica id -> the stats its latest batch carried
        self._tasks: set[asyncio.Task] = set()
        self._closed = False

    def start(self, on_outputs: OnOutputs, on_failure: OnFailure, on_lost: OnLost | None = None) -> None:
        # Ray Serve replaces failed replicas itself: a failure is only ever one call's (on_lost).
        self._on_outputs, self._on_lost = on_outputs, on_lost

    def add(self, requests: list[CoreRequest]) -> None:
        call = _Call(self._handle.options(stream=True).generate.remote(requests), {r.request_id for r in requests})
        for sid in call.open:
            self._calls[sid] = call
        task = asyncio.get_running_loop().create_task(self._pump(call))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _pump(self, call: _Call) -> None:
        try:
            async for outputs, stats, replica in call.stream:
                if call.replica is None:
                    call.replica = replica
                    if call.pending_aborts:
                        self._abort_on(call, call.pending_aborts)
                self._stats[replica] = stats
                for out in outputs:
                    if out.finish_reason is not None:
                        call.open.discard(out.request_id)
                        self._calls.pop(out.request_id, None)
                if outputs:
                    self._on_outputs(outputs)
        except asyncio.CancelledError:
            return
        except Exception as exc:  # the replica died (or its core failed) with these sequences on it
            lost = sorted(call.open)
            if call.replica is not None:
                self._stats.pop(call.replica, None)
            if lost and not self._closed and self._on_lost is not None:
                where = f"engine replica {call.replica}" if call.replica else "an engine replica"
                self._on_lost(lost, ReplicaLostError(f"{where} failed while serving this request "
                                                     f"({type(exc).__name__}); send it again"))
        finally:
            for sid in call.open:
                self._calls.pop(sid, None)
            call.open.clear()

    def abort(self, request_ids: list[str]) -> None:
        by_call: dict[int, tuple[_Call, list[str]]] = {}
        for sid in request_ids:
            call = self._calls.pop(sid, None)
            if call is not None and sid in call.open:
                call.open.discard(sid)
                by_call.setdefault(id(call), (call, []))[1].append(sid)
        for call, ids in by_call.values():
            if not call.open:
                call.stream.cancel()  # the replica's generator ends and aborts what it still runs
            elif call.replica is None:
                call.pending_aborts.extend(ids)
            else:
                self._abort_on(call, ids)

    def _abort_on(self, call: _Call, ids: list[str]) -> None:
        # One of n sequences (a stop string matched): the rest go on, so only these are aborted,
        # on the replica they run on (the request router honours `target`).
        self._handle.abort.remote(ids, target=call.replica)

    def call(self, call: CoreCall, timeout: float = 60.0) -> CallResult:
        if isinstance(call, GetStats):  # as of the replicas' latest batches: a replica answers nothing else here
            return CallResult(0, self.latest_stats)
        raise ValueError(f"{type(call).__name__} is not available through the Ray deployment (LoRA adapters "
                         "and prefix-cache resets are `ruvllm serve`'s)")

    @property
    def latest_stats(self) -> EngineStats:
        return sum_stats(list(self._stats.values()))

    def replica_states(self) -> list[ReplicaState]:
        return [ReplicaState(i, "up", s) for i, (_, s) in enumerate(sorted(self._stats.items()))]

    @property
    def is_alive(self) -> bool:
        return not self._closed

    def shutdown(self) -> None:
        self._closed = True
        for call in {id(c): c for c in self._calls.values()}.values():
            call.stream.cancel()
        self._calls.clear()
