"""Ollama's native API: /api/chat and /api/generate over the generation service (a translation: the
body into a prompt and SamplingParams, the outputs into Ollama's objects, streamed as NDJSON by
default), and the model routes of ollama_models.py.

A stream is one JSON object a line, each `done: false` with the new text, then one `done: true`
with the finish reason, the token counts and the durations in nanoseconds: `prompt_eval_duration`
is the time to the first token (queueing included), `eval_duration` from there to the last one, and
`load_duration` 0 (the model was loaded at start). Tool calls are read out of the model's text as on
/v1/chat/completions and sent, whole, once the completion ends, their arguments as JSON objects.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing
from datetime import datetime, timezone
from functools import partial
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response

from ruvllm.outputs import CompletionOutput, RequestOutput
from ruvllm.request import FinishReason, Logprob
from ruvllm.server import ollama_models
from ruvllm.server.generation import EnginePrompt, Run, ServerState, state
from ruvllm.server.ollama_protocol import ChatRequest, GenerateRequest, resolve_model
from ruvllm.server.reasoning import Thinking, after_reasoning, thinking_of
from ruvllm.server.tenants import tenant_of
from ruvllm.tools.format import ToolUse
from ruvllm.tools.parsers import CallStream, ToolCall, ToolReader, read_calls

router = APIRouter()
router.include_router(ollama_models.router)


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="microseconds").replace("+00:00", "Z")


def _line(obj: dict[str, Any]) -> str:
    return json.dumps(obj, ensure_ascii=False) + "\n"


def _reason(c: CompletionOutput) -> str:
    return "length" if c.finish_reason == FinishReason.LENGTH else "stop"


def _ns(seconds: float) -> int:
    return max(int(seconds * 1e9), 0)


def _stats(run: Run, started: float, results: list[RequestOutput]) -> dict[str, Any]:
    """The final object's counts and durations (nanoseconds); `started`: when the request came in."""
    end, t = time.monotonic(), run.tracker
    first = t.first if t.first is not None else end
    last = t.last if t.last is not None else first
    out = results[0] if results else None
    return {"total_duration": _ns(end - started), "load_duration": 0,
            "prompt_eval_count": len(out.prompt_token_ids) if out else 0, "prompt_eval_duration": _ns(first - t.start),
            "eval_count": sum(len(c.token_ids) for c in out.outputs) if out else 0, "eval_duration": _ns(last - first)}


def _logprobs(st: ServerState, tokens: list[int], entries: list[dict[int, Logprob]], top_n: int) -> list[dict[str, Any]]:
    def item(token_id: int, logprob: float) -> dict[str, Any]:
        text = st.text_of(token_id)
        return {"token": text, "logprob": max(logprob, -9999.0), "bytes": list(text.encode("utf-8"))}

    return [{**item(tok, entry[tok].logprob),
             "top_logprobs": [item(lp.token_id, lp.logprob)
                              for lp in sorted((lp for lp in entry.values() if lp.rank <= top_n),
                                               key=lambda lp: lp.rank)[:top_n]]}
            for tok, entry in zip(tokens, entries)]


def _tool_calls(calls: list[ToolCall]) -> list[dict[str, Any]]:
    return [{"id": f"call_{uuid.uuid4().hex[:24]}", "function": {"index": i, "name": c.name,
                                                                 "arguments": json.loads(c.arguments)}}
            for i, c in enumerate(calls)]


def _loaded(model: str) -> Response:
    """Ollama's answer to a call with nothing to generate (clients send it to load a model): the
    model is loaded already; the same whether or not the call asked to stream."""
    return JSONResponse({"model": model, "created_at": _now(), "done": True, "done_reason": "load"})


async def _render(st: ServerState, messages: list[dict[str, Any]], tools: ToolUse | None,
                  variables: dict[str, Any] | None = None) -> list[int]:
    return await st.chat_prompt(messages, tools, "messages", variables)


class _Writer:
    """One call's Ollama objects: `piece` writes the new text (message.content or response), the final
    object adds the stats; chat adds the tool calls."""

    def __init__(self, st: ServerState, model: str, chat: bool, top_n: int | None, started: float) -> None:
        self.st, self.model, self.chat, self.top_n, self.started = st, model, chat, top_n, started

    def head(self) -> dict[str, Any]:
        return {"model": self.model, "created_at": _now()}

    def text(self, text: str, calls: list[ToolCall] | None = None, thinking: str | None = None) -> dict[str, Any]:
        """`thinking`: a thinking model's reasoning (or a stream's piece of it), as Ollama gives it:
        message.thinking on chat, thinking beside response on generate."""
        if not self.chat:
            return {"response": text, **({"thinking": thinking} if thinking else {})}
        message: dict[str, Any] = {"role": "assistant", "content": text}
        if thinking:
            message["thinking"] = thinking
        if calls:
            message["tool_calls"] = _tool_calls(calls)
        return {"message": message}

    def logprobs(self, c: CompletionOutput) -> dict[str, Any]:
        if self.top_n is None or not c.token_ids:
            return {}
        return {"logprobs": _logprobs(self.st, c.token_ids, c.logprobs or [], self.top_n)}

    def final(self, run: Run, results: list[RequestOutput], c: CompletionOutput | None,
              extra: dict[str, Any]) -> dict[str, Any]:
        reason = _reason(c) if c is not None else "stop"
        return {**self.head(), **extra, "done": True, "done_reason": reason, **_stats(run, self.started, results)}


def _body(w: _Writer, reader: ToolReader | None, context: list[int] | None, thinking: Thinking | None, run: Run,
          final: list[RequestOutput]) -> dict[str, Any]:
    out = final[0]
    c = out.outputs[0]
    reasoning, text = thinking.split(c.text) if thinking is not None else (None, c.text)
    calls = None
    found = read_calls(reader, text, c.finish_reason.value if c.finish_reason else None)
    if found is not None:
        text, calls = found[0] or "", found[1]
    extra = {**w.text(text, calls, reasoning), **w.logprobs(c)}
    if context is not None:
        extra["context"] = context + list(c.token_ids)
    return w.final(run, final, c, extra)


async def _chunks(w: _Writer, reader: ToolReader | None, context: list[int] | None, thinking: Thinking | None,
                  run: Run) -> AsyncIterator[str]:
    """A line per output that adds text (or logprobs); with tools, text that may be a call's start is
    held until it is known not to be one, and the calls go out in a line of their own at the end."""
    calls = CallStream(reader) if reader is not None else None
    splitter = thinking.splitter() if thinking is not None else None
    last: CompletionOutput | None = None
    tokens: list[int] = []
    async with aclosing(run.following):
        async for _, out in run.following:
            for c in out.outputs:
                last = c
                tokens += c.token_ids
                piece, found, thought = c.text, None, ""
                if splitter is not None:
                    thought, piece = splitter.feed(c.text, c.finished)
                if calls is not None:
                    piece, found = calls.feed(piece, c.finished, c.finish_reason.value if c.finish_reason else None)
                lps = w.logprobs(c)
                if piece or thought or lps:
                    yield _line({**w.head(), **w.text(piece, None, thought), **lps, "done": False})
                if found:
                    yield _line({**w.head(), **w.text("", found), "done": False})
    results = run.finish()
    extra = w.text("")
    if context is not None:
        extra["context"] = context + tokens
    yield _line(w.final(run, results, last, extra))


def _reader(st: ServerState, tools: ToolUse | None) -> ToolReader | None:
    return st.tool_parser if tools is not None and tools.active else None


@router.post("/api/chat")
async def chat(body: ChatRequest, request: Request, st: ServerState = Depends(state)) -> Response:
    started = time.monotonic()
    lora = resolve_model(st, body.model, tenant_of(request, None))
    variables = body.check_think(st)
    body.check_supported()
    if not body.messages:
        return _loaded(body.model)
    tools = ToolUse.from_request(body.tools or None, None, None)  # Ollama has no tool_choice: always auto
    messages, last = [m.as_chat() for m in body.messages], body.messages[-1]
    prefill = last.content if last.role == "assistant" and not last.tool_calls and len(messages) > 1 else None
    if prefill:  # a last assistant message is continued, as Ollama does: its text follows the generation prompt
        messages.pop()
    ids = await _render(st, messages, tools, variables)
    if prefill:
        ids += await asyncio.to_thread(st.engine.tokenizer.encode, prefill, add_special_tokens=False)
    prompt = EnginePrompt(ids, None)
    params = body.options.sampling_params(body.options.budget(len(prompt.token_ids), st.max_len), body.structured(),
                                          body.top_n())
    thinking = await thinking_of(st, ids)
    params = after_reasoning(st, params, thinking)
    w, reader = _Writer(st, body.model, True, body.top_n(), started), _reader(st, tools)
    return await st.serve(request, [prompt], [params], "ollama-chat-", lora, partial(_chunks, w, reader, None, thinking),
                          partial(_body, w, reader, None, thinking), user=None, stream=body.stream)


@router.post("/api/generate")
async def generate(body: GenerateRequest, request: Request, st: ServerState = Depends(state)) -> Response:
    started = time.monotonic()
    lora = resolve_model(st, body.model, tenant_of(request, None))
    variables = body.check_think(st)
    body.check_supported(st.engine.info.vocab_size)
    if not body.prompt:
        return _loaded(body.model)
    if body.raw:  # the client rendered the prompt itself
        ids = list(await asyncio.to_thread(st.engine.tokenizer.encode, body.prompt))
    else:
        messages = ([{"role": "system", "content": body.system}] if body.system else []) + \
                   [{"role": "user", "content": body.prompt}]
        ids = await _render(st, messages, None, variables)
    context = list(body.context or [])
    prompt = EnginePrompt(context + ids, body.prompt if body.raw and not context else None)
    params = body.options.sampling_params(body.options.budget(len(prompt.token_ids), st.max_len), body.structured(),
                                          body.top_n())
    thinking = await thinking_of(st, prompt.token_ids)
    params = after_reasoning(st, params, thinking)
    w = _Writer(st, body.model, False, body.top_n(), started)
    # `context` (the conversation's tokens so far, for the next call) is Ollama's older way to keep a
    # conversation: given for raw prompts too
    return await st.serve(request, [prompt], [params], "ollama-gen-", lora, partial(_chunks, w, None, prompt.token_ids, thinking),
                          partial(_body, w, None, prompt.token_ids, thinking), user=None, stream=body.stream)
