"""Ray Serve's request-router interface with ruvllm's routing (engine/router.py): the replica that
recently took the prompt's leading blocks, under a load bound, else a consistent hash.

The handle that the front's Ray deployment holds routes every call to the engine replicas through
this class (RequestRouterConfig). A call with a `target` keyword (an abort of sequences that run on
one replica) goes to that replica alone. Load is what Serve knows: the replica's ongoing requests
(its queue-length cache) plus the KV usage the replica reports in its routing stats.
"""

from __future__ import annotations

from typing import Any

from ray.serve.request_router import FIFOMixin, PendingRequest, RequestRouter, RunningReplica

from ruvllm.engine.router import Router, RouterConfig


class RuvllmRequestRouter(FIFOMixin, RequestRouter):
    def initialize_state(self, block_size: int = 16, policy: str = "prefix", load_factor: float = 1.25,
                         **_: Any) -> None:
        self._router = Router(block_size, RouterConfig(policy=policy, load_factor=load_factor))

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        by_id = {r.replica_id.to_full_id_str(): r for r in candidate_replicas}
        target = pending_request.kwargs.get("target") if pending_request is not None else None
        if target is not None:  # an abort: only the replica running those sequences has them
            return [[by_id[target]]] if target in by_id else []
        requests = pending_request.args[0] if pending_request is not None and pending_request.args else None
        if not requests or not hasattr(requests[0], "prompt_token_ids"):  # info, stats: any replica
            return [candidate_replicas]
        first = requests[0]
        loads = {}
        for rid, r in by_id.items():
            queued = self._replica_queue_len_cache.get(r.replica_id) or 0
            loads[rid] = queued + float((r.routing_stats or {}).get("kv_usage", 0.0))
        chosen = self._router.choose(first.prompt_token_ids, (first.cache_salt, first.adapter), loads)
        rest = [r for rid, r in by_id.items() if rid != chosen]
        return [[by_id[chosen]], rest] if rest else [[by_id[chosen]]]

    def on_replica_actor_died(self, replica_id: Any) -> None:
        super().on_replica_actor_died(replica_id)
        self._router.forget(replica_id.to_full_id_str())
