"""Engine outputs -> OpenAI response bodies (chat, completions, streaming chunks), to the letter of
OpenAI's published schema: nullable-but-required fields (`logprobs`, `message.refusal`) are present."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterable
from contextlib import aclosing
from functools import lru_cache
from typing import TYPE_CHECKING, Any

from ruvllm.outputs import CompletionOutput, RequestOutput
from ruvllm.request import Logprob
from ruvllm.tools.parsers import CallStream, ToolCall, ToolReader, read_calls

if TYPE_CHECKING:
    from ruvllm.server.generation import EnginePrompt, Run, ServerState
    from ruvllm.server.protocol import ChatCompletionRequest, CompletionRequest
    from ruvllm.server.reasoning import Thinking

TokenText = Callable[[int], str]


def token_text(tokenizer: Any) -> TokenText:
    """How a single token reads on its own (for logprobs), cached per token id."""
    return lru_cache(maxsize=None)(lambda token_id: tokenizer.decode([token_id], skip_special_tokens=False))


def usage(results: list[RequestOutput]) -> dict[str, Any]:
    """OpenAI's usage object; `prompt_tokens_details.cached_tokens`: prompt tokens served by the prefix cache."""
    prompt = sum(len(r.prompt_token_ids) for r in results)
    completion = sum(len(c.token_ids) for r in results for c in r.outputs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": sum(r.num_cached_tokens for r in results)}}


def _top(entry: dict[int, Logprob], n: int) -> list[Logprob]:
    return sorted((lp for lp in entry.values() if lp.rank <= n), key=lambda lp: lp.rank)[:n]


def chat_logprobs(tokens: list[int], entries: list[dict[int, Logprob]], top_n: int,
                  text_of: TokenText) -> dict[str, Any]:
    def item(token_id: int, logprob: float) -> dict[str, Any]:
        t = text_of(token_id)
        return {"token": t, "logprob": max(logprob, -9999.0), "bytes": list(t.encode("utf-8"))}

    return {"content": [{**item(tok, entry[tok].logprob),
                         "top_logprobs": [item(lp.token_id, lp.logprob) for lp in _top(entry, top_n)]}
                        for tok, entry in zip(tokens, entries)], "refusal": None}


def completion_logprobs(tokens: list[int], entries: list[dict[int, Logprob] | None], top_n: int,
                        text_of: TokenText) -> dict[str, Any]:
    """OpenAI's legacy logprobs object. With echo the first prompt token has no logprob (null)."""
    out: dict[str, list[Any]] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    offset = 0
    for tok, entry in zip(tokens, entries):
        t = text_of(tok)
        out["tokens"].append(t)
        out["text_offset"].append(offset)
        offset += len(t)
        out["token_logprobs"].append(None if entry is None else max(entry[tok].logprob, -9999.0))
        out["top_logprobs"].append(None if entry is None else
                                   {text_of(lp.token_id): max(lp.logprob, -9999.0) for lp in _top(entry, top_n)})
    return out


def sse(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


_SLOT = "\x00choices\x00"  # JSON writes it as an escape no id, name or number contains


def sse_frames(before: dict[str, Any], after: dict[str, Any]) -> Callable[[list[dict[str, Any]]], str]:
    """`sse({**before, "choices": choices, **after})` for any `choices`, byte for byte, with the fixed
    fields encoded once per stream rather than once per token."""
    text, slot = json.dumps({**before, "choices": _SLOT, **after}, ensure_ascii=False), json.dumps(_SLOT)
    if "choices" in before or "choices" in after or text.count(slot) != 1:
        return lambda choices: sse({**before, "choices": choices, **after})
    head, _, tail = text.partition(slot)
    return lambda choices: f"data: {head}{json.dumps(choices, ensure_ascii=False)}{tail}\n\n"


def _reason(c: CompletionOutput) -> str | None:
    return c.finish_reason.value if c.finish_reason is not None else None


def _call_json(call: ToolCall) -> dict[str, Any]:
    return {"id": f"call-{uuid.uuid4().hex}", "type": "function",
            "function": {"name": call.name, "arguments": call.arguments}}


def _head(st: ServerState, run: Run, obj: str) -> dict[str, Any]:
    return {"id": run.id, "object": obj, "created": int(time.time()), "model": run.model}


def _body(st: ServerState, run: Run, obj: str, results: list[RequestOutput],
          choice: Callable[[int, RequestOutput, CompletionOutput], dict[str, Any]]) -> dict[str, Any]:
    """A whole response: each prompt's (index `pi`) completions, as `choice` writes them."""
    choices = [choice(pi, out, c) for pi, out in enumerate(results) for c in out.outputs]
    return {**_head(st, run, obj), "choices": choices, "usage": usage(results)}


async def _chunks(st: ServerState, body: Any, run: Run, obj: str, first: Iterable[dict[str, Any]],
                  choices: Callable[[int, CompletionOutput], Iterable[dict[str, Any]]]) -> AsyncIterator[str]:
    """A streamed response: the `first` choices, then those `choices` writes of each prompt's DELTA
    outputs (each holds only what is new), one a chunk; the usage (when asked for) and [DONE]."""
    head = _head(st, run, obj)
    usage_asked = bool(body.stream_options and body.stream_options.include_usage)
    extra = {"usage": None} if usage_asked else {}  # null until the last chunk
    frame = sse_frames(head, extra)
    for choice in first:
        yield frame([choice])
    async with aclosing(run.following):
        async for pi, out in run.following:
            for c in out.outputs:
                for choice in choices(pi, c):
                    yield frame([choice])
    results = run.finish()
    if usage_asked:
        yield sse({**head, "choices": [], "usage": usage(results)})
    yield "data: [DONE]\n\n"


def _delta(i: int, delta: dict[str, Any], lps: Any = None, reason: str | None = None) -> dict[str, Any]:
    return {"index": i, "delta": delta, "logprobs": lps, "finish_reason": reason}


def chat_body(st: ServerState, body: ChatCompletionRequest, reader: ToolReader | None, run: Run,
              final: list[RequestOutput], thinking: Thinking | None = None) -> dict[str, Any]:
    """With a thinking model, the reasoning is the message's `reasoning_content` (vLLM's and
    DeepSeek's name) and `reasoning` (OpenRouter's and newer vLLM's), null when there was none; tool
    calls are read from the content after it."""
    def choice(_: int, out: RequestOutput, c: CompletionOutput) -> dict[str, Any]:
        top_n = body.top_logprobs or 0
        lps = chat_logprobs(c.token_ids, c.logprobs or [], top_n, st.text_of) if body.logprobs else None
        text = c.text
        message: dict[str, Any] = {"role": "assistant", "content": text, "refusal": None}
        if thinking is not None:
            reasoning, text = thinking.split(c.text)
            message.update(content=text, reasoning_content=reasoning, reasoning=reasoning)
        reason = _reason(c)
        calls = read_calls(reader, text, reason)
        if calls is not None:
            message["content"], reason = calls[0], "tool_calls"
            message["tool_calls"] = [_call_json(k) for k in calls[1]]
        return {"index": c.index, "message": message, "logprobs": lps, "finish_reason": reason}

    return _body(st, run, "chat.completion", final, choice)


def chat_chunks(st: ServerState, body: ChatCompletionRequest, reader: ToolReader | None,
                run: Run, thinking: Thinking | None = None) -> AsyncIterator[str]:
    """With tools, a completion's calls go out as `tool_calls` deltas (each whole: id, name and
    arguments in one) once it ends, and its finish reason is `tool_calls` (tools/parsers.py's CallStream).
    With a thinking model, the reasoning goes out as `reasoning_content` (and `reasoning`) deltas as it
    comes, the content after it as `content` deltas (tools/reasoning.py's ReasoningSplitter)."""
    n = body.n or 1
    calls_of = [CallStream(reader) for _ in range(n)] if reader is not None else None
    splits = [thinking.splitter() for _ in range(n)] if thinking is not None else None

    def choices(_: int, c: CompletionOutput) -> Iterable[dict[str, Any]]:
        if not c.text and not c.token_ids and not c.finished:
            return
        lps = chat_logprobs(c.token_ids, c.logprobs or [], body.top_logprobs or 0, st.text_of) \
            if body.logprobs and c.token_ids else None
        reason, piece, calls = _reason(c), c.text, None
        if splits is not None:
            thought, piece = splits[c.index].feed(c.text, c.finished)
            if thought:
                yield _delta(c.index, {"reasoning_content": thought, "reasoning": thought}, lps)
                lps = None
            if not piece and not c.finished and lps is None:
                return  # all said as reasoning, or held (a tag's possible start): no content delta
        if calls_of is not None:
            piece, calls = calls_of[c.index].feed(piece, c.finished, reason)
        if calls is not None:
            if piece:
                yield _delta(c.index, {"content": piece})
            yield _delta(c.index, {"tool_calls": [{"index": k, **_call_json(call)} for k, call in enumerate(calls)]},
                         lps)
            piece, reason, lps = "", "tool_calls", None
        yield _delta(c.index, {"content": piece} if piece else {}, lps, reason)

    return _chunks(st, body, run, "chat.completion.chunk",
                   [_delta(i, {"role": "assistant", "content": ""}) for i in range(n)], choices)


def _completion_choice(st: ServerState, body: CompletionRequest, p: EnginePrompt, first: RequestOutput,
                       c: CompletionOutput, echo: bool) -> tuple[str, dict[str, Any] | None]:
    """A text completion's text and logprobs (or a stream's piece of them); with `echo`, the prompt's
    before them (its first token's logprob is null)."""
    text, tokens, entries = c.text, list(c.token_ids), list(c.logprobs or [])
    if echo:
        text = (p.text if p.text is not None else st.engine.tokenizer.decode(p.token_ids)) + text
        tokens, entries = p.token_ids + tokens, list(first.prompt_logprobs or [None] * len(p.token_ids)) + entries
    lps = completion_logprobs(tokens, entries, body.logprobs, st.text_of) if body.logprobs is not None else None
    return text, lps


def completion_body(st: ServerState, body: CompletionRequest, prompts: list[EnginePrompt], run: Run,
                    results: list[RequestOutput]) -> dict[str, Any]:
    def choice(pi: int, out: RequestOutput, c: CompletionOutput) -> dict[str, Any]:
        text, lps = _completion_choice(st, body, prompts[pi], out, c, bool(body.echo))
        return {"index": pi * len(out.outputs) + c.index, "text": text, "logprobs": lps, "finish_reason": _reason(c)}

    return _body(st, run, "text_completion", results, choice)


def completion_chunks(st: ServerState, body: CompletionRequest, prompts: list[EnginePrompt],
                      run: Run) -> AsyncIterator[str]:
    n, echoed = body.n or 1, set()

    def choices(pi: int, c: CompletionOutput) -> Iterable[dict[str, Any]]:
        idx = pi * n + c.index  # the prompt goes with a choice's first piece
        echo = bool(body.echo) and idx not in echoed
        echoed.add(idx)
        first = run.following.gathered[pi].first
        text, lps = _completion_choice(st, body, prompts[pi], first, c, echo)  # type: ignore[arg-type]
        if text or c.token_ids or c.finished:  # a piece without tokens has no logprobs
            yield {"index": idx, "text": text, "logprobs": lps if echo or c.token_ids else None,
                   "finish_reason": _reason(c)}

    return _chunks(st, body, run, "text_completion", (), choices)
