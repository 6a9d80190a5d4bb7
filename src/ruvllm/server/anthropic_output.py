"""Engine outputs -> Anthropic's Messages objects: the message body (content blocks, stop_reason,
usage), or its stream of named server-sent events (message_start, content blocks as they come,
message_delta, message_stop), to the letter of the `anthropic` SDK's types."""

from __future__ import annotations

import json
import secrets
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import TYPE_CHECKING, Any

from ruvllm.outputs import CompletionOutput, RequestOutput
from ruvllm.request import FinishReason
from ruvllm.tools.parsers import CallStream, ToolCall, ToolReader, read_calls

if TYPE_CHECKING:
    from ruvllm.server.generation import Run
    from ruvllm.server.reasoning import Thinking


def _id(run: Run) -> str:
    return run.id  # msg_<hex>: Anthropic's shape, and the id feedback and the witness log know it by


def _tool_block(call: ToolCall) -> dict[str, Any]:
    return {"type": "tool_use", "id": f"toolu_{secrets.token_hex(12)}", "name": call.name,
            "input": json.loads(call.arguments)}


def _stop(c: CompletionOutput, called: bool, max_tokens: int) -> tuple[str | None, str | None]:
    """(stop_reason, stop_sequence): a stop string the client gave is its stop_sequence; EOS is end_turn;
    a reply cut short of max_tokens by the context window is model_context_window_exceeded."""
    if called:
        return "tool_use", None
    if c.finish_reason is FinishReason.LENGTH:
        return ("max_tokens" if len(c.token_ids) >= max_tokens else "model_context_window_exceeded"), None
    if c.finish_reason is FinishReason.STOP:
        return ("stop_sequence", c.stop_reason) if isinstance(c.stop_reason, str) else ("end_turn", None)
    return None, None


def _usage(out: RequestOutput) -> dict[str, Any]:
    """Anthropic's counts: input_tokens are those not read from the prefix cache (the cache's are
    cache_read_input_tokens, so their sum is the prompt). Our cache fills as a side effect, asked for
    by nobody: no tokens are counted as written to it."""
    cached = out.num_cached_tokens
    return {"input_tokens": len(out.prompt_token_ids) - cached, "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": cached, "output_tokens": sum(len(c.token_ids) for c in out.outputs)}


def _thinking_block(text: str) -> dict[str, Any]:
    """A thinking model's reasoning. `signature` is required by the SDK's type: Anthropic's is an
    opaque proof that a block sent back was not altered. Here it is empty: a thinking block sent back
    is left out of the prompt (chat templates drop earlier turns' reasoning), so nothing checks it."""
    return {"type": "thinking", "thinking": text, "signature": ""}


def message(reader: ToolReader | None, max_tokens: int, thinking: Thinking | None, run: Run,
             final: list[RequestOutput]) -> dict[str, Any]:
    out = final[0]
    c = out.outputs[0]
    reasoning, text = thinking.split(c.text) if thinking is not None else (None, c.text)
    found = read_calls(reader, text, c.finish_reason.value if c.finish_reason else None)
    text, calls = (text, []) if found is None else found
    content = ([_thinking_block(reasoning)] if reasoning is not None else []) + \
        ([{"type": "text", "text": text}] if text else []) + [_tool_block(k) for k in calls]
    reason, sequence = _stop(c, bool(calls), max_tokens)
    return {"id": _id(run), "type": "message", "role": "assistant", "model": run.model, "content": content,
            "stop_reason": reason, "stop_sequence": sequence, "usage": _usage(out)}


def _event(kind: str, body: dict[str, Any]) -> str:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **body}, ensure_ascii=False)}\n\n"


class _Blocks:
    """The content blocks of a stream, numbered as they open: the reasoning (first, when the model
    thinks), text while it comes, then each call. One block is open at a time: opening one closes
    the one before."""

    def __init__(self) -> None:
        self.index = 0
        self.open: str | None = None  # the open block's type: "thinking" or "text"

    def thinking(self, piece: str) -> list[str]:
        """The reasoning's block: opened (even before any of it came), then thinking_delta events."""
        return self._write("thinking", _thinking_block(""), {"type": "thinking_delta", "thinking": piece} if piece
                           else None)

    def text(self, piece: str) -> list[str]:
        return self._write("text", {"type": "text", "text": ""}, {"type": "text_delta", "text": piece})

    def _write(self, kind: str, empty: dict[str, Any], delta: dict[str, Any] | None) -> list[str]:
        frames = []
        if self.open != kind:
            frames = self.close()
            frames.append(_event("content_block_start", {"index": self.index, "content_block": empty}))
            self.open = kind
        if delta is not None:
            frames.append(_event("content_block_delta", {"index": self.index, "delta": delta}))
        return frames

    def close(self) -> list[str]:
        if self.open is None:
            return []
        self.open = None
        self.index += 1
        return [_event("content_block_stop", {"index": self.index - 1})]

    def tool(self, call: ToolCall) -> list[str]:
        """A call goes out whole, once its completion has ended (tools/parsers.py's CallStream): its
        input as one input_json_delta."""
        block = _tool_block(call)
        closed = self.close()
        i = self.index
        self.index += 1
        return [*closed,
                _event("content_block_start", {"index": i, "content_block": {**block, "input": {}}}),
                _event("content_block_delta", {"index": i, "delta": {"type": "input_json_delta",
                                                                     "partial_json": call.arguments}}),
                _event("content_block_stop", {"index": i})]


async def events(reader: ToolReader | None, max_tokens: int, thinking: Thinking | None,
                 run: Run) -> AsyncIterator[str]:
    """message_start (sent with the first output, which says how much of the prompt the prefix cache
    held), ping, the content blocks as they come, message_delta (stop_reason, stop_sequence and the
    final usage) and message_stop."""

    def start(out: RequestOutput) -> list[str]:
        return [_event("message_start", {"message": {
            "id": _id(run), "type": "message", "role": "assistant", "model": run.model, "content": [],
            "stop_reason": None, "stop_sequence": None, "usage": {**_usage(out), "output_tokens": 0}}}),
            _event("ping", {})]

    started, called = False, False
    blocks, calls_of = _Blocks(), CallStream(reader) if reader is not None else None
    splitter = thinking.splitter() if thinking is not None else None
    async with aclosing(run.following):
        async for _, out in run.following:
            frames = [] if started else start(out)
            started = True
            c = out.outputs[0]
            piece, calls = c.text, None
            if splitter is not None:
                thought, piece = splitter.feed(c.text, c.finished)
                if thought or (splitter.opened and blocks.open != "thinking" and blocks.index == 0):
                    frames += blocks.thinking(thought)
                if splitter.state == "content" and blocks.open == "thinking":  # the reasoning has ended: its block too
                    frames += blocks.close()
            if calls_of is not None:
                piece, calls = calls_of.feed(piece, c.finished, c.finish_reason.value if c.finish_reason else None)
            if piece:
                frames += blocks.text(piece)
            for call in calls or ():
                called = True
                frames += blocks.tool(call)
            for frame in frames:
                yield frame
    final = run.finish()[0]
    for frame in ([] if started else start(final)) + blocks.close():
        yield frame
    reason, sequence = _stop(final.outputs[0], called, max_tokens)
    yield _event("message_delta", {"delta": {"stop_reason": reason, "stop_sequence": sequence},
                                   "usage": _usage(final)})
    yield _event("message_stop", {})
