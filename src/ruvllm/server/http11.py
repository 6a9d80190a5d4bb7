"""uvicorn's HTTP/1.1 protocol on httptools (llhttp, a C parser), with a limit on a request's head
and malformed requests answered the way clients can read.

httptools rather than h11: at one stream the front's CPU a token is taken from the cores the engine
computes on (docs/performance.md, "The server's front per token"), and h11 parses and frames every
chunk in Python where uvicorn's httptools protocol writes a chunk's frame in one join.

What uvicorn's httptools protocol lacks, added here:
- a limit on the request line + headers (llhttp has none: a client could send headers without
  end). Past MAX_HEADER_BYTES the request gets 431 in OpenAI's error shape;
- a malformed request gets 400 in that shape rather than uvicorn's plain text;
- after either answer the connection reads (and drops) what the client still sends for a moment
  before closing: closing while a client is still sending its headers resets the connection, and
  the client would see the reset instead of the answer.
"""

from __future__ import annotations

import json
import logging
from typing import Any

import httptools
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

from ruvllm.server.errors import error_body

log = logging.getLogger(__name__)

MAX_HEADER_BYTES = 64 * 1024  # request line + headers; past it: 431
_LINGER_S = 2.0


class _HeadTooLarge(Exception):
    """Raised from a parser callback: httptools turns it into an HttpParserCallbackError."""


class RuvllmHttpToolsProtocol(HttpToolsProtocol):
    """The head is measured two ways, because httptools reports a header only once it is whole:
    the bytes of every read after which the head is still incomplete (a head sent without end is
    refused once those pass the limit, before the parser has buffered much more), and, when the head
    completes, its URL and header fields (a head that came in one read)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._lingering = False
        self._in_head = False  # a request has begun and its headers are not all in
        self._head_reads = 0  # bytes of the reads that ended inside this head
        self._head_fields = 0  # its URL and header fields so far

    def data_received(self, data: bytes) -> None:
        if self._lingering:
            return  # what a refused client still sends is read and dropped
        self._unset_keepalive_if_required()
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            if self._should_upgrade():
                self.handle_websocket_upgrade()
            else:
                self._unsupported_upgrade_warning()
        except httptools.HttpParserError as exc:
            if isinstance(exc.__context__, _HeadTooLarge) or isinstance(exc.__cause__, _HeadTooLarge):
                self._refuse_head()
            else:
                log.warning("invalid HTTP request: %s", exc)
                self._refuse(400, f"invalid HTTP request: {exc}")
            return
        if self._in_head:
            self._head_reads += len(data)  # (may count the tail of the request before it: one read at most)
            if self._head_reads > MAX_HEADER_BYTES:
                self._refuse_head()

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._in_head, self._head_reads, self._head_fields = True, 0, 0

    def on_url(self, url: bytes) -> None:
        super().on_url(url)
        self._head_fields += len(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._head_fields += len(name) + len(value) + 4  # with ": " and the line's end
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        self._in_head = False
        if self._head_fields > MAX_HEADER_BYTES:
            raise _HeadTooLarge  # before a request cycle starts for it
        super().on_headers_complete()

    def _refuse_head(self) -> None:
        self._refuse(431, f"the request's headers exceed {MAX_HEADER_BYTES} bytes")

    def _refuse(self, status: int, message: str) -> None:
        """`status` with OpenAI's error body, the connection closed after a linger."""
        body = json.dumps(error_body(status, message, None, "invalid_request")).encode("ascii")
        head = [STATUS_LINE[status]]
        for name, value in self.server_state.default_headers:
            head += [name, b": ", value, b"\r\n"]
        head += [b"content-type: application/json\r\ncontent-length: ", str(len(body)).encode("ascii"),
                 b"\r\nconnection: close\r\n\r\n"]
        self.transport.write(b"".join(head) + body)
        self._lingering = True
        self.loop.call_later(_LINGER_S, self._close_if_open)

    def send_400_response(self, msg: str) -> None:  # uvicorn's own calls (none left from data_received)
        self._refuse(400, f"invalid HTTP request: {msg}")

    def _close_if_open(self) -> None:
        if not self.transport.is_closing():
            self.transport.close()
