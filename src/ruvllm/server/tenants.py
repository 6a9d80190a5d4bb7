"""Which tenant a request belongs to: its API key's (--api-keys), else its `user` field, else
"default" (ruvllm/tenants.py: what a tenant changes)."""

from __future__ import annotations

from pathlib import Path

from starlette.requests import Request

from ruvllm.tenants import DEFAULT_TENANT


def tenant_of(request: Request, user: str | None) -> str:
    return tenant_named(getattr(request.state, "tenant", None), user)


def tenant_named(key_tenant: str | None, user: str | None) -> str:
    """The tenant of a request whose key names `key_tenant` (None: no key, or one that lets `user` say)."""
    return key_tenant or user or DEFAULT_TENANT


def named_by_user(request: Request, user: str | None) -> bool:
    """Whether the request's tenant is its `user` field's (no key said one), not the default."""
    return getattr(request.state, "tenant", None) is None and user not in (None, "", DEFAULT_TENANT)


def read_api_keys(path: str | Path) -> tuple[tuple[str, str], ...]:
    """`KEY TENANT` per line (blank lines and `#` comments skipped). Errors name the line."""
    path = Path(path).expanduser()
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"--api-keys {path}: cannot read it ({e})") from None
    keys: dict[str, str] = {}
    for n, line in enumerate(text.splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        parts = line.split()
        if len(parts) != 2:
            raise ValueError(f"--api-keys {path}:{n}: expected `KEY TENANT`, got {len(parts)} fields")
        key, tenant = parts
        if key in keys:
            raise ValueError(f"--api-keys {path}:{n}: a key is listed twice")
        keys[key] = tenant
    if not keys:
        raise ValueError(f"--api-keys {path}: no keys")
    return tuple(keys.items())
