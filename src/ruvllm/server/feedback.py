"""POST /v1/feedback: a tenant's feedback on one of its completions, learned at once (docs/learning.md)."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fastapi import APIRouter, Depends, Request
from pydantic import BaseModel, ConfigDict, StrictFloat, StrictInt

from ruvllm.engine.generation import GenerationService
from ruvllm.server.backlog import Backlog
from ruvllm.server.config import ServerConfig
from ruvllm.server.errors import APIError
from ruvllm.server.generation import ServerState, state
from ruvllm.server.tenants import named_by_user, tenant_of

if TYPE_CHECKING:  # the learner (and torch) are imported by a server that learns, not by every server
    from ruvllm.learning.learner import FeedbackEvent, FeedbackResult

router = APIRouter()


class FeedbackRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    id: str
    score: StrictFloat | StrictInt  # `true` and "1" are not scores
    correction: str | None = None
    user: str | None = None  # the tenant, when API keys do not say it


class Feedback:
    """The server's side of learning: a rate per tenant, one update at a time on a thread of its own
    (at the learner's priority), a bounded backlog learned a backlog at a time (server/backlog.py),
    and the deep loop's trigger."""

    def __init__(self, cfg: ServerConfig, service: GenerationService, model: str, learned_dir: Path,
                 nice: int) -> None:
        self.cfg, self.limiter = cfg, RateLimiter(cfg.feedback_rate, cfg.feedback_burst)
        # one update thread; the events waiting for it are learned together, each tenant's coalesced
        self.updates: Backlog[FeedbackEvent, FeedbackResult] = Backlog(service.feedback_many, nice)
        self.waiting = 0  # feedback requests in the update thread or queued for it (the event loop alone counts)
        self.deep = DeepTrigger(cfg, model, learned_dir) if cfg.deep_every else None
        # may tenants named by `user` learn: by default, only on a server without keys (docs/decisions.md)
        user_tenants = cfg.learn_user_tenants
        self.user_tenants = not (cfg.api_key or cfg.api_keys or cfg.admin_key) if user_tenants is None else user_tenants

    async def learn(self, who: str, body: FeedbackRequest) -> dict[str, Any]:
        if not self.limiter.allow(who):
            raise APIError(429, f"too much feedback: at most {self.cfg.feedback_rate:g} events a second per tenant",
                           None, "rate_limit_exceeded")
        if self.waiting >= self.cfg.max_waiting_updates:  # the update thread is behind: say so, queue nothing
            raise APIError(429, f"learning is behind: {self.waiting} feedback events wait for their update; "
                                "try again later", None, "rate_limit_exceeded")
        from ruvllm.learning import learner  # imported at the server's start when it learns (its Learner)

        event = learner.FeedbackEvent(body.id, who, body.score, body.correction)
        self.waiting += 1
        try:
            result = await asyncio.wrap_future(self.updates.submit(event))
        finally:
            self.waiting -= 1
        if self.deep is not None:
            self.deep.feedback(who, 1.0 if body.correction else abs(body.score))
        return {"id": body.id, "object": "feedback", "status": "learned", "adapter": result.version,
                "loss": result.loss, "update_ms": round(result.step_ms, 3), "prepare_ms": round(result.prepare_ms, 3),
                "publish_ms": round(result.publish_ms, 3), "step_events": result.events}

    async def close(self) -> None:
        """An update in progress finishes before the learner's stores close."""
        await asyncio.to_thread(self.updates.close)


class RateLimiter:
    """A token bucket per tenant: `rate` events a second, bursts of up to `burst`."""

    def __init__(self, rate: float, burst: int) -> None:
        self.rate, self.burst = rate, burst
        self._buckets: dict[str, tuple[float, float]] = {}
        self._lock = threading.Lock()

    def allow(self, tenant: str) -> bool:
        now = time.monotonic()
        with self._lock:
            tokens, last = self._buckets.get(tenant, (float(self.burst), now))
            tokens = min(self.burst, tokens + (now - last) * self.rate)
            if tokens < 1:
                self._buckets[tenant] = (tokens, now)
                return False
            self._buckets[tenant] = (tokens - 1, now)
            return True


class DeepTrigger:
    """Starts `ruvllm learn run TENANT` (the deep loop, at low priority, in a process of its own) once a
    tenant's feedback since its last run weighs `deep_every`: each event by how much it says (|score|; a
    correction, the strongest signal, 1), so a few firm corrections trigger it sooner than many lukewarm
    ratings. One run at a time (a tenant that reaches the weight meanwhile waits for its next event).
    The server serves what it promotes at its next request (the policy store's change)."""

    def __init__(self, cfg: ServerConfig, model: str, learned_dir: Path) -> None:
        if not cfg.deep_heldout:
            raise ValueError("the deep loop's trigger needs held-out text (--deep-heldout FILE)")
        self.cfg, self.model, self.dir = cfg, model, learned_dir
        self.weights: dict[str, float] = {}
        self.running: subprocess.Popen | None = None
        self.runs: list[tuple[str, subprocess.Popen]] = []
        self._lock = threading.Lock()

    def feedback(self, tenant: str, weight: float) -> None:
        with self._lock:
            self.weights[tenant] = self.weights.get(tenant, 0.0) + weight
            if self.running is not None and self.running.poll() is None:
                return
            if self.weights[tenant] < self.cfg.deep_every - 1e-9:
                return
            self.weights[tenant] = 0.0
            cfg = self.cfg
            args = [sys.executable, "-m", "ruvllm.cli.main", "learn", "run", tenant, "--heldout", str(cfg.deep_heldout),
                    "--model", self.model, "--dir", str(self.dir), "--witness-log", cfg.witness_log or "off"]
            for flag, value in (("--general", cfg.deep_general), ("--probes", cfg.deep_probes)):
                if value:
                    args += [flag, value]
            self.running = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            self.runs.append((tenant, self.running))


@router.post("/v1/feedback")
async def feedback(request: Request, body: FeedbackRequest, st: ServerState = Depends(state)) -> dict[str, Any]:
    """Feedback on one of the tenant's completions, learned at once (docs/learning.md)."""
    if st.feedback is None:
        raise APIError(400, "this server does not learn from feedback (start it with --learn)", None,
                       "learning_disabled")
    if not st.feedback.user_tenants and named_by_user(request, body.user):
        raise APIError(403, "this request's tenant is named by its `user` field, and on this server only the "
                            "tenants of API keys learn (the operator allows `user` tenants with "
                            "--learn-user-tenants)", "user", "user_tenant_cannot_learn")
    return await st.feedback.learn(tenant_of(request, body.user), body)
