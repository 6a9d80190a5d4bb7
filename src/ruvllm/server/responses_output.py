"""Engine outputs -> OpenAI Responses objects: the response body, and its stream of typed events
(`event:` line and `data:` with `type` and `sequence_number`), to the letter of the `openai` SDK's
models. One `Turn` per request: it echoes the request's settings in every response object, gives the
output items their ids once (a stream and its final response name the same items), and files the
finished response in the store when the request asked for that."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass, field
from itertools import count
from typing import TYPE_CHECKING, Any

from ruvllm.outputs import CompletionOutput, RequestOutput
from ruvllm.server.errors import api_error, error_body
from ruvllm.server.response_store import ResponseStore
from ruvllm.server.responses_protocol import Item, ResponsesRequest, new_id
from ruvllm.tools.format import ToolUse
from ruvllm.tools.parsers import CallStream, ToolCall, ToolReader, read_calls

if TYPE_CHECKING:
    from ruvllm.server.generation import Run
    from ruvllm.server.reasoning import Thinking

log = logging.getLogger(__name__)

# ResponseError.code is one of OpenAI's fixed values: ours mapped by status (anything else: server_error)
_FAILED_CODES = {429: "rate_limit_exceeded", 400: "invalid_prompt"}


def usage(results: list[RequestOutput]) -> dict[str, Any]:
    """Responses' usage. `cache_write_tokens` counts explicitly requested cache writes, which this
    server has none of (its prefix cache keeps every prompt's blocks unasked): 0."""
    inp = sum(len(r.prompt_token_ids) for r in results)
    out = sum(len(c.token_ids) for r in results for c in r.outputs)
    return {"input_tokens": inp, "output_tokens": out, "total_tokens": inp + out,
            "input_tokens_details": {"cached_tokens": sum(r.num_cached_tokens for r in results),
                                     "cache_write_tokens": 0},
            "output_tokens_details": {"reasoning_tokens": 0}}


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _message(item_id: str, text: str | None, status: str) -> Item:
    """An assistant message item; `text` None: just opened, no content part yet."""
    return {"id": item_id, "type": "message", "role": "assistant", "status": status,
            "content": [] if text is None else [_text_part(text)]}


def _reasoning_item(item_id: str, text: str | None, status: str) -> Item:
    """A thinking model's reasoning as a reasoning item: its text as one reasoning_text part (`text`
    None: just opened), no summary (nothing here writes one)."""
    return {"id": item_id, "type": "reasoning", "summary": [], "status": status,
            "content": [] if text is None else [_reasoning_part(text)]}


def _reasoning_part(text: str) -> dict[str, Any]:
    return {"type": "reasoning_text", "text": text}


def _call_item(call: ToolCall, status: str, arguments: str | None = None) -> Item:
    return {"id": new_id("fc"), "type": "function_call", "status": status, "call_id": new_id("call"),
            "name": call.name, "arguments": call.arguments if arguments is None else arguments}


def _reason(c: CompletionOutput) -> str | None:
    return c.finish_reason.value if c.finish_reason is not None else None


@dataclass
class Turn:
    body: ResponsesRequest
    tools: ToolUse | None
    reader: ToolReader | None  # how calls are read back when tools are active
    context: list[Item]  # the stored conversation before this request's input (previous_response_id)
    items: list[Item]  # this request's input, normalised
    store: ResponseStore | None  # None: not stored (store: false)
    tenant: str
    created_at: int = field(default_factory=lambda: int(time.time()))
    thinking: Thinking | None = None  # a thinking model's: its reasoning is an item of its own

    def response(self, run: Run, status: str, output: list[Item], use: dict[str, Any] | None,
                 error: dict[str, Any] | None = None) -> dict[str, Any]:
        """The response object, with every field the SDK's `Response` requires and the request's
        settings echoed as OpenAI echoes them."""
        b = self.body
        fmt = b.text.format if b.text is not None and b.text.format is not None else None
        return {
            "id": response_id(run), "object": "response", "created_at": self.created_at, "status": status,
            "background": False, "error": error,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": b.instructions, "max_output_tokens": b.max_output_tokens, "model": run.model,
            "output": output, "parallel_tool_calls": True if b.parallel_tool_calls is None else b.parallel_tool_calls,
            "previous_response_id": b.previous_response_id,
            "reasoning": b.reasoning if b.reasoning is not None else {"effort": None, "summary": None},
            "store": bool(b.store), "temperature": 1.0 if b.temperature is None else b.temperature,
            "text": {"format": fmt.model_dump(by_alias=True, exclude_none=True) if fmt else {"type": "text"}},
            "tool_choice": b.tool_choice if b.tool_choice is not None else "auto",
            "tools": [_echo_tool(t) for t in b.tools or ()], "top_p": 1.0 if b.top_p is None else b.top_p,
            "truncation": "disabled", "metadata": b.metadata or {},
            # an object and a string when present, in OpenAI's schema: left out rather than null
            **({"usage": use} if use is not None else {}), **({"user": b.user} if b.user is not None else {}),
            **({"completed_at": int(time.time())} if status == "completed" else {}),
        }

    def _keep(self, response: dict[str, Any]) -> None:
        if self.store is not None and not self.store.put(self.tenant, response, self.context, self.items):
            log.warning("response %s not stored: larger than the whole store (%d bytes)", response["id"],
                        self.store.max_bytes)

    def answer(self, run: Run, final: list[RequestOutput]) -> dict[str, Any]:
        c = final[0].outputs[0]
        reason = _reason(c)
        status = "incomplete" if reason == "length" else "completed"
        text, output = c.text, []
        if self.thinking is not None:
            splitter = self.thinking.splitter()
            reasoning, text = splitter.feed(c.text, final=True)
            if splitter.opened:  # incomplete only when cut short inside it, as the stream says
                output.append(_reasoning_item(new_id("rs"), reasoning, status if splitter.state != "content"
                                              else "completed"))
        found = read_calls(self.reader, text, reason)
        content, calls = found if found is not None else (text, [])
        # an empty answer is a message, unless the model only reasoned (cut short, or it called)
        output += [_message(new_id("msg"), content or "", status)] if content or not (calls or output) else []
        output += [_call_item(k, "completed") for k in calls]
        response = self.response(run, status, output, usage(final))
        self._keep(response)
        return response

    async def events(self, run: Run) -> AsyncIterator[str]:
        """The stream: created, in_progress; per item added ... done (a message's text as deltas as it
        comes; a call whole, once the completion has ended: tools/parsers.py's CallStream); then
        completed (incomplete, when cut at max_output_tokens). An error after the first event ends it
        as OpenAI does: a `response.failed` event, then an `error` event (which the SDK raises)."""
        w = _EventWriter(self)
        head = self.response(run, "in_progress", [], None)
        yield w.event("response.created", response=head)
        yield w.event("response.in_progress", response=head)
        try:
            async with aclosing(run.following):
                async for _, out in run.following:
                    for c in out.outputs:
                        for e in w.feed(c):
                            yield e
            results = run.finish()
            status = "incomplete" if any(_reason(c) == "length" for r in results for c in r.outputs) else "completed"
            final = self.response(run, status, w.output, usage(results))
            self._keep(final)
            yield w.event(f"response.{status}", response=final)
        except Exception as exc:
            err = api_error(exc)
            if err.status == 500 and err.code is None:  # not raised on purpose
                log.exception("response stream failed")
            failure = {"code": _FAILED_CODES.get(err.status, "server_error"), "message": err.message}
            yield w.event("response.failed", response=self.response(run, "failed", w.output, None, failure))
            # the `error` event's own fields, and OpenAI's error object beside them: the SDK raises on that
            yield w.event("error", code=err.code, message=err.message, param=err.param,
                          error=error_body(err.status, err.message, err.param, err.code)["error"])


@dataclass
class _OpenItem:
    """A message or reasoning item of a stream, from its `added` events to its `done` events: one
    content part, its text as deltas, then whole."""
    kind: str  # the part's type: "output_text" (a message) or "reasoning_text"
    item_id: str
    index: int  # its output_index
    pieces: list[str] = field(default_factory=list)

    def item(self, text: str | None, status: str) -> Item:
        make = _message if self.kind == "output_text" else _reasoning_item
        return make(self.item_id, text, status)

    def part(self, text: str) -> dict[str, Any]:
        return _text_part(text) if self.kind == "output_text" else _reasoning_part(text)

    def where(self) -> dict[str, Any]:
        extra = {"logprobs": []} if self.kind == "output_text" else {}  # only text deltas carry logprobs
        return {"item_id": self.item_id, "output_index": self.index, "content_index": 0, **extra}


class _EventWriter:
    """One stream's events: their sequence numbers, the items output so far, the item open now."""

    def __init__(self, turn: Turn) -> None:
        self.seq = count()
        self.output: list[Item] = []
        self.calls = CallStream(turn.reader) if turn.reader is not None else None
        self.splitter = turn.thinking.splitter() if turn.thinking is not None else None
        self.reasoning: _OpenItem | None = None  # once opened (and kept after it is done)
        self.reasoning_done = False
        self.message: _OpenItem | None = None

    def event(self, kind: str, **fields: Any) -> str:
        data = {"type": kind, "sequence_number": next(self.seq), **fields}
        return f"event: {kind}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"

    def open(self, kind: str, prefix: str) -> tuple[_OpenItem, list[str]]:
        it = _OpenItem(kind, new_id(prefix), len(self.output))
        return it, [self.event("response.output_item.added", output_index=it.index, item=it.item(None, "in_progress")),
                    self.event("response.content_part.added", item_id=it.item_id, output_index=it.index,
                               content_index=0, part=it.part(""))]

    def delta(self, it: _OpenItem, piece: str) -> str:
        it.pieces.append(piece)
        return self.event(f"response.{it.kind}.delta", **it.where(), delta=piece)

    def close(self, it: _OpenItem, status: str) -> list[str]:
        whole = "".join(it.pieces)
        item = it.item(whole, status)
        self.output.append(item)
        return [self.event(f"response.{it.kind}.done", **it.where(), text=whole),
                self.event("response.content_part.done", item_id=it.item_id, output_index=it.index,
                           content_index=0, part=it.part(whole)),
                self.event("response.output_item.done", output_index=it.index, item=item)]

    def feed(self, c: CompletionOutput) -> list[str]:
        """The events one engine output adds: reasoning first (a thinking model's), then the message's
        text, then, once finished, the message closed and each call whole."""
        reason = _reason(c)
        status = "incomplete" if reason == "length" else "completed"
        events: list[str] = []
        piece = c.text
        if self.splitter is not None:
            more, piece = self.splitter.feed(c.text, c.finished)
            events += self._reasoning(more, c.finished, status)
        piece, calls = self.calls.feed(piece, c.finished, reason) if self.calls else (piece, None)
        # an empty answer is a message, unless the model only reasoned
        if self.message is None and (piece or (c.finished and not calls and self.reasoning is None)):
            self.message, opened = self.open("output_text", "msg")
            events += opened
        if piece:
            events.append(self.delta(self.message, piece))
        if c.finished:
            if self.message is not None:
                events += self.close(self.message, status)
            for call in calls or ():
                events += self._call(call)
        return events

    def _reasoning(self, more: str, finished: bool, status: str) -> list[str]:
        events: list[str] = []
        if self.splitter.opened and self.reasoning is None:
            self.reasoning, events = self.open("reasoning_text", "rs")
        if more:
            events.append(self.delta(self.reasoning, more))
        if self.reasoning is not None and not self.reasoning_done and (self.splitter.state == "content" or finished):
            self.reasoning_done = True  # the reasoning has ended: its item is done
            events += self.close(self.reasoning, status if self.splitter.state != "content" else "completed")
        return events

    def _call(self, call: ToolCall) -> list[str]:
        item = _call_item(call, "in_progress", "")
        at = len(self.output)
        done = {**item, "arguments": call.arguments, "status": "completed"}
        self.output.append(done)
        return [self.event("response.output_item.added", output_index=at, item=item),
                self.event("response.function_call_arguments.delta", item_id=item["id"], output_index=at,
                           delta=call.arguments),
                self.event("response.function_call_arguments.done", item_id=item["id"], output_index=at,
                           name=call.name, arguments=call.arguments),
                self.event("response.output_item.done", output_index=at, item=done)]


def response_id(run: Run) -> str:
    """`resp_<hex>`: the call's id, the one feedback and the witness log name it by."""
    return run.id


def _echo_tool(tool: dict[str, Any]) -> dict[str, Any]:
    return {"type": "function", "name": tool.get("name"), "description": tool.get("description"),
            "parameters": tool.get("parameters"), "strict": tool.get("strict")}
