"""The HTTP protocol's own answers (server/http11.py on httptools): a request head past the limit is
431 however it arrives, a malformed request is 400, both in OpenAI's error shape, and a head just
under the limit is served."""

from __future__ import annotations

import asyncio
import json

from tests.server.conftest import MODEL, RunningServer
from tests.server.raw_http import exchange, open_conn, parse_response, request_bytes

from ruvllm.server.http11 import MAX_HEADER_BYTES

COMP = {"model": MODEL, "prompt": "Hi", "max_tokens": 2, "temperature": 0}


def _error(got: tuple[int, dict[str, str], bytes], status: int) -> str:
    code, headers, body = got
    assert code == status, body[:300]
    assert headers["content-type"] == "application/json"
    err = json.loads(body)["error"]
    assert {"message", "type", "param", "code"} <= set(err)
    return err["message"]


def test_head_just_under_the_limit_is_served(server: RunningServer) -> None:
    raw = request_bytes("POST", "/v1/completions", COMP, headers={"X-Filler": "a" * (MAX_HEADER_BYTES - 1024)})
    status, _, body = asyncio.run(exchange(server.url, raw))
    assert status == 200, body[:300]
    assert json.loads(body)["usage"]["completion_tokens"] == 2


def test_head_over_the_limit_in_one_read_is_431(server: RunningServer) -> None:
    """Whole (its end included) and a little over the limit: counted from its fields."""
    raw = request_bytes("POST", "/v1/completions", COMP, headers={"X-Filler": "a" * (MAX_HEADER_BYTES + 10)})
    assert str(MAX_HEADER_BYTES) in _error(asyncio.run(exchange(server.url, raw)), 431)


def test_head_without_end_is_431_while_it_is_sent(server: RunningServer) -> None:
    """A head that never ends, sent in pieces: answered once the limit has passed, while the client
    is still sending (not after it stops), and the connection then closes."""

    async def run() -> tuple[int, dict[str, str], bytes]:
        reader, writer = await open_conn(server.url)
        answered = asyncio.Event()

        async def send() -> int:
            writer.write(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Endless: ")
            sent = 0
            while not answered.is_set() and sent < 16 * MAX_HEADER_BYTES:  # (a loaded host: room to answer late)
                writer.write(b"a" * 8192)
                await writer.drain()
                sent += 8192
                await asyncio.sleep(0.005)
            return sent

        sender = asyncio.create_task(send())
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 30)
            answered.set()
            assert await sender < 16 * MAX_HEADER_BYTES, "no answer while the head went on"
            return parse_response(head + await asyncio.wait_for(reader.read(), 10))  # closed after it
        finally:
            writer.close()

    _error(asyncio.run(run()), 431)


def test_malformed_request_is_400_and_the_connection_closes(server: RunningServer) -> None:
    got = asyncio.run(exchange(server.url, b"GET /health HTTP/1.1\r\nHost: x\r\nBad Header\r\n\r\n"))
    assert _error(got, 400).startswith("invalid HTTP request")


def test_keep_alive_serves_requests_in_turn(server: RunningServer) -> None:
    """Two requests on one connection, the second sent in the same write as the first (pipelined):
    each answered, in order."""
    one = request_bytes("POST", "/v1/completions", COMP).replace(b"Connection: close\r\n", b"")
    two = request_bytes("GET", "/health")

    async def run() -> bytes:
        reader, writer = await open_conn(server.url)
        try:
            writer.write(one + two)
            await writer.drain()
            return await asyncio.wait_for(reader.read(), 30)
        finally:
            writer.close()

    data = asyncio.run(run())
    assert data.count(b"HTTP/1.1 200 OK") == 2, data[:500]
    assert data.index(b'"completion_tokens"') < data.rindex(b"HTTP/1.1 200 OK")
