"""HTTP/1.1 written by hand on asyncio sockets: for requests no well-behaved client sends (cut short,
dropped at a chosen byte, oversized headers)."""

from __future__ import annotations

import asyncio
import json
from urllib.parse import urlsplit


def request_bytes(method: str, path: str, body: dict | bytes | None = None,
                  headers: dict[str, str] | None = None, content_length: int | None = None) -> bytes:
    data = body if isinstance(body, bytes) else (json.dumps(body).encode() if body is not None else b"")
    lines = [f"{method} {path} HTTP/1.1", "Host: 127.0.0.1", "Connection: close"]
    if body is not None:
        lines += ["Content-Type: application/json", f"Content-Length: {content_length or len(data)}"]
    lines += [f"{k}: {v}" for k, v in (headers or {}).items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + data


async def open_conn(url: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    parts = urlsplit(url)
    return await asyncio.open_connection(parts.hostname, parts.port)


async def exchange(url: str, raw: bytes, timeout: float = 30.0) -> tuple[int, dict[str, str], bytes]:
    """Send `raw`, read the whole response (the server closes: Connection: close)."""
    reader, writer = await open_conn(url)
    try:
        writer.write(raw)
        await writer.drain()
        data = await asyncio.wait_for(reader.read(), timeout)
    finally:
        writer.close()
    return parse_response(data)


def parse_response(data: bytes) -> tuple[int, dict[str, str], bytes]:
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = {k.strip().lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:])}
    if headers.get("transfer-encoding") == "chunked":
        body = _unchunk(body)
    return status, headers, body


def _unchunk(data: bytes) -> bytes:
    out, rest = [], data
    while rest:
        size_line, _, rest = rest.partition(b"\r\n")
        size = int(size_line.split(b";")[0] or b"0", 16)
        if size == 0:
            break
        out.append(rest[:size])
        rest = rest[size + 2:]
    return b"".join(out)
