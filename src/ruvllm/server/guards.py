"""What every request passes before a route sees it: the API key, and limits on the request body.

Both are pure ASGI middlewares (not BaseHTTPMiddleware, which hides client disconnects from the
handlers), and both answer in OpenAI's error shape.
"""

from __future__ import annotations

import asyncio
import ctypes
import hashlib
import hmac
from collections.abc import Iterable

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ruvllm.server.config import ServerConfig
from ruvllm.server.errors import error_response
from ruvllm.tenants import DEFAULT_TENANT


# glibc keeps what a large request freed (its parsed body, the tokenizer's buffers in the worker
# threads' arenas) as free heap for later allocations; trimmed, the pages go back to the system
# (issue 33, item 12: the front went from 333 MB to 1,069 MB after the bad-input table, 9 MB of it live
# Python objects). Elsewhere there is nothing to trim.
TRIM_AFTER_BYTES = 1 << 20
_malloc_trim = getattr(ctypes.CDLL(None), "malloc_trim", None)
_trimming = False


async def give_back_memory() -> None:
    """malloc_trim(0) on a worker thread, one at a time (a trim asked for during one is skipped)."""
    global _trimming
    if _malloc_trim is None or _trimming:
        return
    _trimming = True
    try:
        await asyncio.to_thread(_malloc_trim, 0)
    finally:
        _trimming = False


def _digest(value: bytes) -> bytes:
    return hashlib.sha256(value).digest()


Role = tuple[str | None, bool]  # (the key's tenant, or None: the `user` field says; whether it is the admin's)


def key_roles(cfg: ServerConfig) -> dict[str, Role]:
    """Each key's role. A tenant's key is its tenant's; a shared --api-key lets the `user` field say (with
    tenants' keys, it is the default tenant's: `user` never names a key's tenant); the admin key is no
    tenant's. Shared by HTTP (APIKeyMiddleware) and gRPC."""
    keys: dict[str, Role] = {key: (tenant, False) for key, tenant in cfg.api_keys}
    if cfg.api_key:
        keys[cfg.api_key] = (DEFAULT_TENANT if cfg.api_keys else None, False)
    if cfg.admin_key or cfg.api_key:
        keys[cfg.admin_key or cfg.api_key] = (DEFAULT_TENANT, True)
    return keys


class KeyTable:
    """Keys compared as digests in constant time (against every key, whichever matches), so neither
    their content nor their length leaks through timing."""

    def __init__(self, keys: dict[str, Role]) -> None:
        self.expected = [(_digest(k.encode()), role) for k, role in keys.items()]

    def role(self, token: bytes) -> Role | None:
        given = _digest(token.strip())
        found = None
        for digest, role in self.expected:
            if hmac.compare_digest(given, digest):
                found = role
        return found


def _header(scope: Scope, name: bytes) -> bytes | None:
    return next((value for key, value in scope.get("headers") or () if key.lower() == name), None)


class APIKeyMiddleware:
    """With `required`, every path needs `Authorization: Bearer <key>` (or `x-api-key: <key>`) except those in `open_paths`
    (/health, and what the operator opened); without, a request with no or an unknown key goes on as
    nobody's. The scheme is case-insensitive (RFC 9110); keys are compared as digests in constant
    time (against every key, whichever matches), so neither their content nor their length leaks
    through timing. `keys` maps each key to (its tenant, or None: the `user` field says; whether it
    is the admin's), which the request carries on (`request.state.tenant`, `request.state.admin`)."""

    def __init__(self, app: ASGIApp, keys: dict[str, Role], open_paths: Iterable[str] = ("/health",),
                 required: bool = True) -> None:
        self.app, self.required = app, required
        self.keys = KeyTable(keys)
        self.open_paths = frozenset(open_paths)

    def _role(self, scope: Scope) -> Role | None:
        # Anthropic's clients send the key as `x-api-key`; everyone else's as a bearer token
        scheme, _, token = (_header(scope, b"authorization") or b"").strip().partition(b" ")
        if scheme.lower() != b"bearer":
            token = _header(scope, b"x-api-key") or b""
            if not token:
                return None
        return self.keys.role(token)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            role = self._role(scope)
            if role is None and self.required and scope["path"] not in self.open_paths:
                resp = error_response(401, "invalid or missing API key (send 'Authorization: Bearer <key>')",
                                      None, "invalid_api_key", headers={"WWW-Authenticate": 'Bearer realm="ruvllm"'},
                                      path=scope["path"])
                await resp(scope, receive, send)
                return
            if role is not None:
                scope.setdefault("state", {}).update(zip(("tenant", "admin"), role))
        await self.app(scope, receive, send)


class RequestLimitsMiddleware:
    """Reads the whole body before the app sees it, under two limits: at most `max_body_bytes`
    (413), and at most `read_timeout_s` waiting for the next piece of it (408: a client that
    promised more than it sends is not held open for ever). The app then reads the buffered body;
    later receives (disconnect detection) go to the client as before."""

    def __init__(self, app: ASGIApp, max_body_bytes: int, read_timeout_s: float) -> None:
        self.app, self.max_body_bytes, self.read_timeout_s = app, max_body_bytes, read_timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if await self._serve(scope, receive, send) >= TRIM_AFTER_BYTES:
            await give_back_memory()  # the body, its parsed form and the tokenizer's work are freed by now

    async def _serve(self, scope: Scope, receive: Receive, send: Send) -> int:
        """The request under the limits; the size of its body."""
        declared = _header(scope, b"content-length")
        try:
            bad_length = declared is not None and int(declared) < 0
        except ValueError:
            bad_length = True
        if bad_length:
            await error_response(400, "Content-Length is not a number", None, "invalid_value",
                                 path=scope["path"])(scope, receive, send)
            return 0
        chunks: list[bytes] = []
        size = 0
        while True:
            try:
                message = await asyncio.wait_for(receive(), self.read_timeout_s)
            except TimeoutError:
                await error_response(408, f"the request body did not arrive within {self.read_timeout_s:g} s "
                                          f"({size} bytes received)", None, "request_timeout",
                                     path=scope["path"])(scope, receive, send)
                return size
            if message["type"] == "http.disconnect":
                return size  # the client left before its request was whole: nobody to answer
            size += len(message.get("body", b""))
            if size <= self.max_body_bytes:
                chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                break
        # Read to the end even when too large, so the client is reading when the 413 comes
        # (closing on unread data resets the connection and loses the answer); nothing is kept.
        if size > self.max_body_bytes:
            await error_response(413, f"the request body has {size} bytes; this server takes at most "
                                      f"{self.max_body_bytes} (--max-request-bytes)", None,
                                 "request_too_large", path=scope["path"])(scope, receive, send)
            return size
        body = b"".join(chunks)
        replayed = False

        async def buffered() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, buffered, send)
        return size
