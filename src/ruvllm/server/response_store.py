"""The stored responses of POST /v1/responses (`store`, the default): what GET /v1/responses/{id},
its input items, DELETE, and a later request's `previous_response_id` read.

In memory, per server, and per tenant: a response is filed under (tenant, id), so another tenant's
lookup misses exactly as an absent id does. Bounded three ways, oldest dropped first: a count, a
total of bytes (each entry's JSON size), and an age. Nothing survives a restart; a client that needs
its conversation for longer sends the items again.
"""

from __future__ import annotations

import json
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ruvllm.server.responses_protocol import Item


@dataclass(frozen=True)
class StoredResponse:
    body: dict[str, Any]  # the response object as it was answered
    context: list[Item]  # the conversation before this request's input (its previous_response_id's)
    input: list[Item]  # this request's own input items, with ids
    stored_at: float  # the store's clock
    size: int  # bytes of JSON

    def conversation(self) -> list[Item]:
        """What a request continuing this response (`previous_response_id`) is preceded by: the
        whole conversation so far, this response's output included (but not its instructions)."""
        return [*self.context, *self.input, *self.body["output"]]


class ResponseStore:
    def __init__(self, max_count: int, max_bytes: int, ttl_s: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.max_count, self.max_bytes, self.ttl_s, self.clock = max_count, max_bytes, ttl_s, clock
        self._entries: OrderedDict[tuple[str, str], StoredResponse] = OrderedDict()  # oldest first
        self.bytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, tenant: str, body: dict[str, Any], context: list[Item], input_items: list[Item]) -> bool:
        """Keep a response; False when it alone is larger than the whole byte budget (not kept)."""
        size = len(json.dumps([body, context, input_items], ensure_ascii=False).encode("utf-8"))
        if size > self.max_bytes or self.max_count == 0:
            return False
        key = (tenant, body["id"])
        self._drop(key)
        self._entries[key] = StoredResponse(body, context, input_items, self.clock(), size)
        self.bytes += size
        self._expire()
        while len(self._entries) > self.max_count or self.bytes > self.max_bytes:
            self._drop(next(iter(self._entries)))
        return True

    def get(self, tenant: str, response_id: str) -> StoredResponse | None:
        self._expire()
        return self._entries.get((tenant, response_id))

    def delete(self, tenant: str, response_id: str) -> bool:
        self._expire()
        return self._drop((tenant, response_id))

    def _drop(self, key: tuple[str, str]) -> bool:
        entry = self._entries.pop(key, None)
        if entry is None:
            return False
        self.bytes -= entry.size
        return True

    def _expire(self) -> None:
        """Entries are in the order they were stored, so the expired ones are a prefix."""
        cutoff = self.clock() - self.ttl_s
        while self._entries:
            key, entry = next(iter(self._entries.items()))
            if entry.stored_at > cutoff:
                break
            self._drop(key)
