"""Engine outputs -> OpenAI response bodies (chat, completions, streaming chunks), to the letter of
OpenAI's published schema: nullable-but-required fields (`logprobs`, `message.refusal`) are present."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import TYPE_CHECKING, Any

from ruvllm.outputs import CompletionOutput, RequestOutput
from ruvllm.request import Logprob
from ruvllm.tools.parsers import CallStream, ToolCall, ToolReader, read_calls

if TYPE_CHECKING:
    from ruvllm.server.generation import EnginePrompt, Run, ServerState
    from ruvllm.server.protocol import ChatCompletionRequest, CompletionRequest


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
    """OpenAI's usage object; `prompt_tokens_details.cached_tokens`: prompt tokens served by the prefix cache."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


class TokenText:
    """How a single token reads on its own (for logprobs), cached per token id."""

    def __init__(self, tokenizer: Any) -> None:
        self._tok = tokenizer
        self._cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            text = self._tok.decode([token_id], skip_special_tokens=False)
            self._cache[token_id] = text
        return text


def _top(entry: dict[int, Logprob], n: int) -> list[Logprob]:
    return sorted((lp for lp in entry.values() if lp.rank <= n), key=lambda lp: lp.rank)[:n]


def chat_logprobs(tokens: list[int], entries: list[dict[int, Logprob]], top_n: int,
                  text_of: TokenText) -> dict[str, Any]:
    content = []
    for tok, entry in zip(tokens, entries):
        t = text_of(tok)
        content.append({
            "token": t, "logprob": max(entry[tok].logprob, -9999.0), "bytes": list(t.encode("utf-8")),
            "top_logprobs": [{"token": text_of(lp.token_id), "logprob": max(lp.logprob, -9999.0),
                              "bytes": list(text_of(lp.token_id).encode("utf-8"))} for lp in _top(entry, top_n)],
        })
    return {"content": content, "refusal": None}


def completion_logprobs(tokens: list[int], entries: list[dict[int, Logprob] | None], top_n: int,
                        text_of: TokenText, start_offset: int) -> dict[str, Any]:
    """OpenAI's legacy logprobs object. With echo the first prompt token has no logprob (null)."""
    out: dict[str, list[Any]] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    offset = start_offset
    for tok, entry in zip(tokens, entries):
        t = text_of(tok)
        out["tokens"].append(t)
        out["text_offset"].append(offset)
        offset += len(t)
        if entry is None:
            out["token_logprobs"].append(None)
            out["top_logprobs"].append(None)
            continue
        out["token_logprobs"].append(max(entry[tok].logprob, -9999.0))
        out["top_logprobs"].append({text_of(lp.token_id): max(lp.logprob, -9999.0) for lp in _top(entry, top_n)})
    return out


def sse(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def _reason(c: CompletionOutput) -> str | None:
    return c.finish_reason.value if c.finish_reason is not None else None


def _usage(results: list[RequestOutput]) -> dict[str, Any]:
    return usage(sum(len(r.prompt_token_ids) for r in results), sum(len(c.token_ids) for r in results for c in r.outputs),
                 sum(r.num_cached_tokens for r in results))


def _call_json(call: ToolCall) -> dict[str, Any]:
    return {"id": new_id("call"), "type": "function", "function": {"name": call.name, "arguments": call.arguments}}


def _completion_choice(st: ServerState, body: CompletionRequest, p: EnginePrompt, first: RequestOutput,
                       c: CompletionOutput, echo: bool) -> tuple[str, dict[str, Any] | None]:
    """A text completion's text and logprobs (or a stream's piece of them); with `echo`, the prompt's
    before them (its first token's logprob is null)."""
    text, tokens, entries = c.text, list(c.token_ids), list(c.logprobs or [])
    if echo:
        text = (p.text if p.text is not None else st.engine.tokenizer.decode(p.token_ids)) + text
        tokens, entries = p.token_ids + tokens, list(first.prompt_logprobs or [None] * len(p.token_ids)) + entries
    lps = completion_logprobs(tokens, entries, body.logprobs, st.text_of, 0) if body.logprobs is not None else None
    return text, lps


def _stream_parts(st: ServerState, body: Any, run: Run, obj: str) -> tuple[dict[str, Any], dict[str, Any], bool]:
    """Every chunk's fields, the usage field of each (null until the last chunk, when asked for), and whether asked."""
    usage_asked = bool(body.stream_options and body.stream_options.include_usage)
    return ({"id": run.id, "object": obj, "created": now(), "model": st.cfg.served_model_name},
            {"usage": None} if usage_asked else {}, usage_asked)


def chat_body(st: ServerState, body: ChatCompletionRequest, reader: ToolReader | None, run: Run,
              final: list[RequestOutput]) -> dict[str, Any]:
    out, top_n, choices = final[0], body.top_logprobs or 0, []
    for c in out.outputs:
        lps = chat_logprobs(c.token_ids, c.logprobs or [], top_n, st.text_of) if body.logprobs else None
        message: dict[str, Any] = {"role": "assistant", "content": c.text, "refusal": None}
        reason = _reason(c)
        calls = read_calls(reader, c.text, reason)
        if calls is not None:
            message["content"], message["tool_calls"], reason = calls[0], [_call_json(k) for k in calls[1]], "tool_calls"
        choices.append({"index": c.index, "message": message, "logprobs": lps, "finish_reason": reason})
    return {"id": run.id, "object": "chat.completion", "created": now(), "model": st.cfg.served_model_name,
            "choices": choices, "usage": _usage([out])}


def completion_body(st: ServerState, body: CompletionRequest, prompts: list[EnginePrompt], run: Run,
                    results: list[RequestOutput]) -> dict[str, Any]:
    choices = []
    for pi, (p, out) in enumerate(zip(prompts, results)):
        for c in out.outputs:
            text, lps = _completion_choice(st, body, p, out, c, bool(body.echo))
            choices.append({"index": pi * len(out.outputs) + c.index, "text": text, "logprobs": lps,
                            "finish_reason": _reason(c)})
    return {"id": run.id, "object": "text_completion", "created": now(), "model": st.cfg.served_model_name,
            "choices": choices, "usage": _usage(results)}


async def chat_chunks(st: ServerState, body: ChatCompletionRequest, reader: ToolReader | None,
                      run: Run) -> AsyncIterator[str]:
    """With tools, a completion's calls go out as `tool_calls` deltas (each whole: id, name and
    arguments in one) once it ends, and its finish reason is `tool_calls` (tools/parsers.py's CallStream)."""
    base, extra, usage_asked = _stream_parts(st, body, run, "chat.completion.chunk")
    n, top_n = body.n or 1, body.top_logprobs or 0

    def chunk(i: int, delta: dict[str, Any], lps: Any = None, reason: str | None = None) -> str:
        return sse({**base, "choices": [{"index": i, "delta": delta, "logprobs": lps, "finish_reason": reason}],
                    **extra})

    for i in range(n):
        yield chunk(i, {"role": "assistant", "content": ""})
    calls_of = [CallStream(reader) for _ in range(n)] if reader is not None else None
    async with aclosing(run.following):
        async for _, out in run.following:
            for c in out.outputs:  # DELTA: each holds only what is new
                if not c.text and not c.token_ids and not c.finished:
                    continue
                lps = chat_logprobs(c.token_ids, c.logprobs or [], top_n, st.text_of) if body.logprobs and c.token_ids \
                    else None
                reason, piece, calls = _reason(c), c.text, None
                if calls_of is not None:
                    piece, calls = calls_of[c.index].feed(c.text, c.finished, reason)
                if calls is not None:
                    if piece:
                        yield chunk(c.index, {"content": piece})
                    yield chunk(c.index, {"tool_calls": [{"index": k, **_call_json(call)} for k, call in enumerate(calls)]},
                                lps)
                    piece, reason, lps = "", "tool_calls", None
                yield chunk(c.index, {"content": piece} if piece else {}, lps, reason)
    results = run.finish()
    if usage_asked:
        yield sse({**base, "choices": [], "usage": _usage(results)})
    yield "data: [DONE]\n\n"


async def completion_chunks(st: ServerState, body: CompletionRequest, prompts: list[EnginePrompt],
                            run: Run) -> AsyncIterator[str]:
    base, extra, usage_asked = _stream_parts(st, body, run, "text_completion")
    n, echoed = body.n or 1, set()
    async with aclosing(run.following):
        async for pi, out in run.following:
            for c in out.outputs:  # DELTA: each holds only what is new; the prompt goes with a choice's first
                idx = pi * n + c.index
                echo = bool(body.echo) and idx not in echoed
                echoed.add(idx)
                first = run.following.gathered[pi].first
                text, lps = _completion_choice(st, body, prompts[pi], first, c, echo)  # type: ignore[arg-type]
                if not text and not c.token_ids and not c.finished:
                    continue
                lps = lps if echo or c.token_ids else None  # a piece without tokens has no logprobs
                yield sse({**base, "choices": [{"index": idx, "text": text, "logprobs": lps,
                                                "finish_reason": _reason(c)}], **extra})
    results = run.finish()
    if usage_asked:
        yield sse({**base, "choices": [], "usage": _usage(results)})
    yield "data: [DONE]\n\n"
