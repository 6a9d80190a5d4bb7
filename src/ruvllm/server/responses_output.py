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
        seq = count()

        def event(kind: str, **fields: Any) -> str:
            data = {"type": kind, "sequence_number": next(seq), **fields}
            return f"event: {kind}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"

        output: list[Item] = []
        head = self.response(run, "in_progress", [], None)
        yield event("response.created", response=head)
        yield event("response.in_progress", response=head)
        stream = CallStream(self.reader) if self.reader is not None else None
        splitter = self.thinking.splitter() if self.thinking is not None else None
        rs_id: str | None = None  # the reasoning item, once opened
        rs_done = False
        thought: list[str] = []
        msg_id: str | None = None  # the message item open now
        text: list[str] = []
        try:
            async with aclosing(run.following):
                async for _, out in run.following:
                    for c in out.outputs:
                        reason = _reason(c)
                        status = "incomplete" if reason == "length" else "completed"
                        piece = c.text
                        if splitter is not None:
                            more, piece = splitter.feed(c.text, c.finished)
                            if splitter.opened and rs_id is None:
                                rs_id = new_id("rs")
                                yield event("response.output_item.added", output_index=len(output),
                                            item=_reasoning_item(rs_id, None, "in_progress"))
                                yield event("response.content_part.added", item_id=rs_id, output_index=len(output),
                                            content_index=0, part=_reasoning_part(""))
                            if more:
                                thought.append(more)
                                yield event("response.reasoning_text.delta", item_id=rs_id, output_index=len(output),
                                            content_index=0, delta=more)
                            if rs_id is not None and not rs_done and (splitter.state == "content" or c.finished):
                                rs_done = True
                                whole = "".join(thought)  # the reasoning has ended: its item is done
                                yield event("response.reasoning_text.done", item_id=rs_id, output_index=0,
                                            content_index=0, text=whole)
                                yield event("response.content_part.done", item_id=rs_id, output_index=0,
                                            content_index=0, part=_reasoning_part(whole))
                                item = _reasoning_item(rs_id, whole, status if splitter.state != "content"
                                                       else "completed")
                                yield event("response.output_item.done", output_index=0, item=item)
                                output.append(item)
                        piece, calls = stream.feed(piece, c.finished, reason) if stream else (piece, None)
                        if piece or (c.finished and msg_id is None and not calls and rs_id is None):
                            # an empty answer is a message, unless the model only reasoned
                            if msg_id is None:
                                msg_id = new_id("msg")
                                yield event("response.output_item.added", output_index=len(output),
                                            item=_message(msg_id, None, "in_progress"))
                                yield event("response.content_part.added", item_id=msg_id, output_index=len(output),
                                            content_index=0, part=_text_part(""))
                            if piece:
                                text.append(piece)
                                yield event("response.output_text.delta", item_id=msg_id, output_index=len(output),
                                            content_index=0, delta=piece, logprobs=[])
                        if not c.finished:
                            continue
                        if msg_id is not None:
                            whole = "".join(text)
                            yield event("response.output_text.done", item_id=msg_id, output_index=len(output),
                                        content_index=0, text=whole, logprobs=[])
                            yield event("response.content_part.done", item_id=msg_id, output_index=len(output),
                                        content_index=0, part=_text_part(whole))
                            item = _message(msg_id, whole, status)
                            yield event("response.output_item.done", output_index=len(output), item=item)
                            output.append(item)
                        for call in calls or ():
                            item = _call_item(call, "in_progress", "")
                            yield event("response.output_item.added", output_index=len(output), item=item)
                            yield event("response.function_call_arguments.delta", item_id=item["id"],
                                        output_index=len(output), delta=call.arguments)
                            yield event("response.function_call_arguments.done", item_id=item["id"],
                                        output_index=len(output), name=call.name, arguments=call.arguments)
                            item = {**item, "arguments": call.arguments, "status": "completed"}
                            yield event("response.output_item.done", output_index=len(output), item=item)
                            output.append(item)
            results = run.finish()
            status = "incomplete" if any(_reason(c) == "length" for r in results for c in r.outputs) else "completed"
            final = self.response(run, status, output, usage(results))
            self._keep(final)
            yield event(f"response.{status}", response=final)
        except Exception as exc:
            err = api_error(exc)
            if err.status == 500 and err.code is None:  # not raised on purpose
                log.exception("response stream failed")
            failure = {"code": _FAILED_CODES.get(err.status, "server_error"), "message": err.message}
            yield event("response.failed", response=self.response(run, "failed", output, None, failure))
            # the `error` event's own fields, and OpenAI's error object beside them: the SDK raises on that
            yield event("error", code=err.code, message=err.message, param=err.param,
                        error=error_body(err.status, err.message, err.param, err.code)["error"])


def response_id(run: Run) -> str:
    """`resp_<hex>`: the call's id, the one feedback and the witness log name it by."""
    return run.id


def _echo_tool(tool: dict[str, Any]) -> dict[str, Any]:
    return {"type": "function", "name": tool.get("name"), "description": tool.get("description"),
            "parameters": tool.get("parameters"), "strict": tool.get("strict")}
