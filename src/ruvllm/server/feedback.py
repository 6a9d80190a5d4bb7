"""POST /v1/feedback: a tenant's feedback on one of its completions, learned at once (docs/learning.md)."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path

from pydantic import BaseModel, ConfigDict

from ruvllm.server.config import ServerConfig


class FeedbackRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    id: str
    score: float
    correction: str | None = None
    user: str | None = None  # the tenant, when API keys do not say it


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
    """Starts `ruvllm learn run TENANT` (the deep loop, at low priority, in a process of its own)
    once a tenant's feedback since its last run weighs `deep_every`: each event by how much it says
    (|score|; a correction, the strongest signal, 1), so a few firm corrections trigger it sooner than
    many lukewarm ratings. One run at a time (a tenant that reaches the weight meanwhile waits for
    its next event). The server serves what it promotes at its next request (the policy store's
    change)."""

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
                    "--model", self.model, "--dir", str(self.dir),
                    "--witness-log", cfg.witness_log or "off"]
            if cfg.deep_general:
                args += ["--general", cfg.deep_general]
            if cfg.deep_probes:
                args += ["--probes", cfg.deep_probes]
            self.running = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            self.runs.append((tenant, self.running))
