"""Tenants: whose requests are whose. Every tenant but the default one gets a prefix-cache salt of
its own, so no tenant can learn another's prompts from cache-hit timing; the single-tenant set-up
(every request the default tenant's) keeps sharing."""

from __future__ import annotations

DEFAULT_TENANT = "default"


def tenant_salt(tenant: str) -> str | None:
    return None if tenant == DEFAULT_TENANT else f"tenant:{tenant}"

LEARNED_PREFIX = "learned:"  # learned adapters' names, `learned:<tenant>:v<N>`: reserved, never loaded by name
EVERYONE = "*"  # the learned scope that serves every tenant (learning/deep.py's GLOBAL)


def may_use(tenant: str, adapter: str) -> bool:
    """Whether the tenant may see and name the adapter: a learned one only its own tenant (or, promoted
    for everyone, any); every other adapter anyone."""
    if not adapter.startswith(LEARNED_PREFIX):
        return True
    owner = adapter[len(LEARNED_PREFIX):].rpartition(":")[0]
    return owner in (tenant, EVERYONE)
