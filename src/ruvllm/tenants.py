"""Tenants: whose requests are whose. Every tenant but the default one gets a prefix-cache salt of
its own, so no tenant can learn another's prompts from cache-hit timing; the single-tenant set-up
(every request the default tenant's) keeps sharing."""

from __future__ import annotations

DEFAULT_TENANT = "default"


def tenant_salt(tenant: str) -> str | None:
    return None if tenant == DEFAULT_TENANT else f"tenant:{tenant}"
