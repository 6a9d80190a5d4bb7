"""Anthropic's Messages API (POST /v1/messages, /v1/messages/count_tokens). A translation only: the
body into our chat messages, tools and SamplingParams for the generation service; its outputs into
Anthropic's message, or its stream of named server-sent events. Errors take Anthropic's shape by
path (errors.py's ANTHROPIC dialect)."""

from __future__ import annotations

import asyncio
import json
import secrets
from collections.abc import AsyncIterator
from contextlib import aclosing
from functools import partial
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response

from ruvllm.outputs import CompletionOutput, RequestOutput
from ruvllm.request import FinishReason
from ruvllm.sampling_params import SamplingParams
from ruvllm.server.anthropic_protocol import CountTokensRequest, MessagesRequest
from ruvllm.server.errors import APIError
from ruvllm.server.generation import EnginePrompt, Run, ServerState, check_context, state
from ruvllm.server.reasoning import Thinking, after_reasoning, template_vars, thinking_of
from ruvllm.server.tenants import tenant_of
from ruvllm.structured.spec import StructuredOutputs
from ruvllm.tools.format import ToolUse
from ruvllm.tools.parsers import CallStream, JsonCallParser, ToolCall, ToolReader, read_calls

router = APIRouter()


@router.post("/v1/messages")
async def messages(body: MessagesRequest, request: Request, st: ServerState = Depends(state)) -> Response:
    lora = st.check_model(body.model, tenant_of(request, body.user))
    tools = tool_use(body)
    prompt = EnginePrompt(await prompt_ids(st, body, tools), None)
    # max_tokens is a ceiling, as Anthropic's newer models treat it: a reply runs to the end of the
    # context window at most and then stops as model_context_window_exceeded (clients send 32000
    # and more whatever the model). Only a prompt that leaves no room at all is a 400.
    budget = min(body.max_tokens, check_context(prompt, None, st.max_len))
    thinking = await thinking_of(st, prompt.token_ids)
    params = after_reasoning(st, sampling_params(body, budget, tools), thinking)
    reader: ToolReader | None = None
    if tools is not None and tools.active:
        reader = JsonCallParser() if tools.constrained else st.tool_parser
    return await st.serve(request, [prompt], [params], "msg_", lora, partial(_events, reader, body.max_tokens, thinking),
                          partial(_message, reader, body.max_tokens, thinking), user=body.user, stream=body.stream)


@router.post("/v1/messages/count_tokens")
async def count_tokens(body: CountTokensRequest, request: Request, st: ServerState = Depends(state)) -> dict[str, Any]:
    """The prompt's length as messages.create would run it: the template, the system text and the tools."""
    st.check_model(body.model, tenant_of(request, None))
    return {"input_tokens": len(await prompt_ids(st, body, tool_use(body)))}


# ---- the request, translated ----

def _text(value: Any, where: str) -> str:
    if not isinstance(value, str):
        raise APIError(400, f"{where}: must be a string", where)
    return value


def _unsupported(kind: Any, where: str) -> APIError:
    return APIError(400, f"{where}: content blocks of type {kind!r} are not supported by this server (it serves "
                         "text, tool_use and tool_result blocks)", where)


def _texts(blocks: Any, where: str) -> str:
    """Text blocks (a system prompt, a tool's result) as one text; any other kind is a 400."""
    if isinstance(blocks, str):
        return blocks
    if not isinstance(blocks, list):
        raise APIError(400, f"{where}: must be a string or a list of text blocks", where)
    parts = []
    for k, b in enumerate(blocks):
        if not isinstance(b, dict) or b.get("type") != "text":
            raise _unsupported(b.get("type") if isinstance(b, dict) else b, f"{where}.{k}")
        parts.append(_text(b.get("text"), f"{where}.{k}.text"))
    # Separate blocks are separate paragraphs (Claude Code sends a reminder and the request as two)
    return "\n\n".join(parts)


def chat_messages(body: CountTokensRequest) -> tuple[list[dict[str, Any]], str | None]:
    """The conversation as our chat messages (OpenAI's shape, which tools/format.py writes into the
    template): tool_use blocks become an assistant's `tool_calls`, tool_result blocks `tool` messages.
    A last assistant message is a prefill, returned apart: the reply continues it."""
    out: list[dict[str, Any]] = []
    if body.system is not None:
        out.append({"role": "system", "content": _texts(body.system, "system")})
    names: dict[str, str] = {}  # tool_use id -> its function, for templates that name a result's tool
    for i, m in enumerate(body.messages):
        where = f"messages.{i}.content"
        blocks = [{"type": "text", "text": m.content}] if isinstance(m.content, str) else m.content
        texts: list[str] = []
        if m.role == "assistant":
            calls = []
            for k, b in enumerate(blocks):
                kind = b.get("type")
                if kind == "text":
                    texts.append(_text(b.get("text"), f"{where}.{k}.text"))
                elif kind == "tool_use":
                    call_id, name, args = b.get("id"), b.get("name"), b.get("input", {})
                    if not isinstance(call_id, str) or not isinstance(name, str) or not isinstance(args, dict):
                        raise APIError(400, f"{where}.{k}: a tool_use block needs an id, a name and an input object",
                                       f"{where}.{k}")
                    names[call_id] = name
                    calls.append({"id": call_id, "type": "function", "function": {"name": name, "arguments": args}})
                elif kind in ("thinking", "redacted_thinking"):
                    continue  # an earlier turn's reasoning, sent back as clients must: the template has no place for it
                else:
                    raise _unsupported(kind, f"{where}.{k}")
            msg: dict[str, Any] = {"role": "assistant", "content": "\n\n".join(texts)}
            if calls:
                msg["tool_calls"] = calls
            out.append(msg)
            continue
        results = []
        for k, b in enumerate(blocks):
            kind = b.get("type")
            if kind == "text":
                texts.append(_text(b.get("text"), f"{where}.{k}.text"))
            elif kind == "tool_result":
                call_id = b.get("tool_use_id")
                if not isinstance(call_id, str):
                    raise APIError(400, f"{where}.{k}.tool_use_id: must be a string", f"{where}.{k}.tool_use_id")
                content = _texts(b.get("content", ""), f"{where}.{k}.content")
                if b.get("is_error"):  # the model should know the call failed, not read an error as a value
                    content = "Error: " + content
                results.append({"role": "tool", "tool_call_id": call_id, "content": content,
                                **({"name": names[call_id]} if call_id in names else {})})
            else:
                raise _unsupported(kind, f"{where}.{k}")
        out.extend(results)
        if texts or not results:
            out.append({"role": "user", "content": "\n\n".join(texts)})
    prefill = None
    if out[-1]["role"] == "assistant":
        if out[-1].get("tool_calls"):
            raise APIError(400, "messages: the last message may be the assistant's text to continue, but not its "
                                "tool_use blocks: send their tool_result blocks in a user message", "messages")
        prefill = out.pop()["content"]
    return out, prefill


def tool_use(body: CountTokensRequest) -> ToolUse | None:
    """Anthropic's tools and tool_choice as tools/format.py's ToolUse: `any` is OpenAI's `required`,
    `tool` a named function, `disable_parallel_tool_use` one call at most."""
    functions = []
    for i, t in enumerate(body.tools or []):
        where = f"tools.{i}"
        if t.get("type") not in (None, "custom"):
            # Anthropic's own tools (web_search_..., code_execution_..., bash_..., text_editor_...) have no
            # schema here and nothing here runs them: left out of the prompt, so that a client that lists
            # them by default still gets its custom tools served (docs/server.md)
            continue
        name, schema = t.get("name"), t.get("input_schema")
        if not isinstance(name, str) or not name:
            raise APIError(400, f"{where}.name: a tool needs a name", f"{where}.name")
        if not isinstance(schema, dict):
            raise APIError(400, f"{where}.input_schema: a tool needs a JSON schema object", f"{where}.input_schema")
        desc = t.get("description")
        functions.append({"type": "function", "function": {"name": name, "parameters": schema,
                                                           **({"description": desc} if isinstance(desc, str) else {})}})
    choice, mapped = body.tool_choice, None
    if choice is not None:
        if choice.type == "tool":
            if not choice.name:
                raise APIError(400, "tool_choice.name: a tool_choice of type tool names the tool", "tool_choice.name")
            mapped = {"type": "function", "function": {"name": choice.name}}
        else:
            mapped = {"auto": "auto", "any": "required", "none": "none"}[choice.type]
    parallel = not (choice is not None and choice.disable_parallel_tool_use)
    return ToolUse.from_request(functions, mapped, parallel)


async def prompt_ids(st: ServerState, body: CountTokensRequest, tools: ToolUse | None) -> list[int]:
    msgs, prefill = chat_messages(body)
    ids = await st.chat_prompt(msgs, tools, "messages", _thinking_vars(body))
    if prefill:  # the assistant's turn is open: its text follows the generation prompt, as the model wrote it
        ids += await asyncio.to_thread(st.engine.tokenizer.encode, prefill, add_special_tokens=False)
    return list(ids)


def _thinking_vars(body: CountTokensRequest) -> dict[str, Any]:
    """Anthropic's `thinking` as the template's enable_thinking: enabled (or adaptive) is true,
    disabled false; absent, the template's own default."""
    kind = body.thinking.get("type") if isinstance(body.thinking, dict) else None
    if body.thinking is not None and kind not in ("enabled", "disabled", "adaptive"):
        raise APIError(400, "thinking.type must be one of enabled, disabled, adaptive", "thinking.type")
    return template_vars(None if kind is None else kind != "disabled", None, ("thinking", "thinking"))


def sampling_params(body: MessagesRequest, max_tokens: int, tools: ToolUse | None) -> SamplingParams:
    """At most one constraint: a forced tool call's grammar, or output_config.format's schema."""
    structured, field = (tools.constraint(), "tools") if tools is not None else (None, "tools")
    fmt = body.output_config.format if body.output_config is not None else None
    if fmt is not None:
        if structured is not None:
            raise APIError(400, "output_config.format and a forced tool call (tool_choice any or tool) both constrain "
                                "the output: give one", "output_config.format")
        structured, field = StructuredOutputs(json_schema=fmt.schema_, field="output_config.format"), \
            "output_config.format"
    if structured is not None:
        try:  # the syntax, here where the field is known (the engine checks it again)
            structured.check()
        except ValueError as exc:
            raise APIError(400, f"{field}: not a usable JSON schema: {exc}", field) from None
    try:
        return SamplingParams(temperature=1.0 if body.temperature is None else body.temperature,
                              top_p=1.0 if body.top_p is None else body.top_p, top_k=body.top_k or 0,
                              stop=body.stop_sequences, max_tokens=max_tokens, structured=structured)
    except ValueError as exc:
        raise APIError(400, str(exc), str(exc).split(" ", 1)[0]) from None


# ---- the outputs, translated ----

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


def _message(reader: ToolReader | None, max_tokens: int, thinking: Thinking | None, run: Run,
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
    """The content blocks of a stream, numbered as they open: text while it comes, then each call."""

    def __init__(self) -> None:
        self.index, self.text_open, self.thinking_open = 0, False, False

    def thinking(self, piece: str) -> list[str]:
        """The reasoning's block (first, when the model thinks): thinking_delta events as it comes."""
        frames = []
        if not self.thinking_open:
            frames.append(_event("content_block_start", {"index": self.index,
                                                         "content_block": _thinking_block("")}))
            self.thinking_open = True
        if piece:
            frames.append(_event("content_block_delta", {"index": self.index,
                                                         "delta": {"type": "thinking_delta", "thinking": piece}}))
        return frames

    def close_thinking(self) -> list[str]:
        if not self.thinking_open:
            return []
        self.thinking_open = False
        self.index += 1
        return [_event("content_block_stop", {"index": self.index - 1})]

    def text(self, piece: str) -> list[str]:
        frames = self.close_thinking()
        if not self.text_open:
            frames.append(_event("content_block_start", {"index": self.index,
                                                         "content_block": {"type": "text", "text": ""}}))
            self.text_open = True
        frames.append(_event("content_block_delta", {"index": self.index,
                                                     "delta": {"type": "text_delta", "text": piece}}))
        return frames

    def close_text(self) -> list[str]:
        if not self.text_open:
            return []
        self.text_open = False
        self.index += 1
        return [_event("content_block_stop", {"index": self.index - 1})]

    def tool(self, call: ToolCall) -> list[str]:
        """A call goes out whole, once its completion has ended (tools/parsers.py's CallStream): its
        input as one input_json_delta."""
        block = _tool_block(call)
        closed = self.close_thinking() + self.close_text()
        i = self.index
        self.index += 1
        return [*closed,
                _event("content_block_start", {"index": i, "content_block": {**block, "input": {}}}),
                _event("content_block_delta", {"index": i, "delta": {"type": "input_json_delta",
                                                                     "partial_json": call.arguments}}),
                _event("content_block_stop", {"index": i})]


async def _events(reader: ToolReader | None, max_tokens: int, thinking: Thinking | None,
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
                if thought or (splitter.opened and not blocks.thinking_open and blocks.index == 0):
                    frames += blocks.thinking(thought)
                if splitter.state == "content":  # the reasoning has ended: its block too
                    frames += blocks.close_thinking()
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
    for frame in ([] if started else start(final)) + blocks.close_thinking() + blocks.close_text():
        yield frame
    reason, sequence = _stop(final.outputs[0], called, max_tokens)
    yield _event("message_delta", {"delta": {"stop_reason": reason, "stop_sequence": sequence},
                                   "usage": _usage(final)})
    yield _event("message_stop", {})
