"""uvicorn's HTTP/1.1 protocol (h11), answering malformed requests the way clients can read.

uvicorn answers every request h11 cannot parse with a plain-text 400 and closes at once. For a
request whose headers are too large that is the wrong status, and closing while the client is still
sending its headers resets the connection, so the client sees a reset instead of any answer. Here
such a request gets 431 in OpenAI's error shape, and the connection reads (and drops) what the client
still sends for a moment before closing, so the answer arrives.
"""

from __future__ import annotations

import json
from typing import Any

import h11
from h11._connection import DEFAULT_MAX_INCOMPLETE_EVENT_SIZE
from uvicorn.protocols.http.h11_impl import STATUS_PHRASES, H11Protocol

from ruvllm.server.errors import error_body

MAX_HEADER_BYTES = 64 * 1024  # request line + headers; past it: 431 (h11's own default is 16 KiB)
_LINGER_S = 2.0


class RuvllmH11Protocol(H11Protocol):
    """Give it uvicorn's `h11_max_incomplete_event_size` (MAX_HEADER_BYTES by default in
    server/process.py) as the header limit."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._lingering = False

    def data_received(self, data: bytes) -> None:
        if self._lingering:
            return  # what a refused client still sends is read and dropped
        super().data_received(data)

    def send_400_response(self, msg: str) -> None:
        limit = self.config.h11_max_incomplete_event_size or DEFAULT_MAX_INCOMPLETE_EVENT_SIZE
        too_large = len(self.conn.trailing_data[0]) > limit
        status = 431 if too_large else 400
        message = f"the request's headers exceed {limit} bytes" if too_large else f"invalid HTTP request: {msg}"
        body = json.dumps(error_body(status, message, None, "invalid_request")).encode("ascii")
        headers = [(b"content-type", b"application/json"), (b"connection", b"close")]
        self.transport.write(self.conn.send(h11.Response(status_code=status, headers=headers,
                                                         reason=STATUS_PHRASES[status])))
        self.transport.write(self.conn.send(h11.Data(data=body)))
        self.transport.write(self.conn.send(h11.EndOfMessage()))
        self._lingering = True
        self.loop.call_later(_LINGER_S, self._close_if_open)

    def _close_if_open(self) -> None:
        if not self.transport.is_closing():
            self.transport.close()
