"""POST /v1/feedback: a tenant's feedback on one of its completions, learned at once (docs/learning.md)."""

from __future__ import annotations

import threading
import time

from pydantic import BaseModel, ConfigDict


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
