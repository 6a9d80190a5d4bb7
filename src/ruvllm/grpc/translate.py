"""A GenerateRequest into what the generation service takes (a prompt's token ids, SamplingParams, a
priority), and the engine's outputs into the API's messages. A translation only: every check past
the message's shape is the one the HTTP dialects use (SamplingParams, check_context, the engine's
check_request), raised as APIError so that errors.py's one table says what it means."""

from __future__ import annotations

import asyncio
from typing import Any

from ruvllm.grpc import ruvllm_pb2 as pb
from ruvllm.outputs import CompletionOutput, RequestOutput
from ruvllm.request import FinishReason
from ruvllm.sampling_params import SamplingParams
from ruvllm.server.errors import APIError
from ruvllm.server.generation import EnginePrompt, ServerState
from ruvllm.server.protocol import MAX_STOP, USER_MAX_CHARS
from ruvllm.structured.spec import StructuredOutputs

DEFAULT_MAX_TOKENS = 16  # as /v1/completions: a request that sets nothing gets a short answer, not the context
ROLES = ("system", "developer", "user", "assistant", "tool")
_PRIORITIES = {pb.PRIORITY_UNSPECIFIED: None, pb.PRIORITY_LOW: "low", pb.PRIORITY_NORMAL: "normal",
               pb.PRIORITY_HIGH: "high", pb.PRIORITY_CRITICAL: "critical"}
_FINISH = {FinishReason.STOP: pb.FINISH_REASON_STOP, FinishReason.LENGTH: pb.FINISH_REASON_LENGTH,
           FinishReason.ABORT: pb.FINISH_REASON_ABORT}


def bad(message: str, field: str) -> APIError:
    return APIError(400, f"{field}: {message}", field, "invalid_value")


def user_of(req: pb.GenerateRequest) -> str | None:
    """The `user` field, bounded as on HTTP (it names a tenant: a label, a cache salt, a witness field)."""
    if len(req.user) > USER_MAX_CHARS:
        raise bad(f"at most {USER_MAX_CHARS} characters, got {len(req.user)}", "user")
    return req.user or None


def priority_of(req: pb.GenerateRequest) -> str | None:
    if req.priority not in _PRIORITIES:  # proto3 enums are open: any number arrives
        raise bad(f"unknown value {req.priority}", "priority")
    return _PRIORITIES[req.priority]


async def prompt_of(st: ServerState, req: pb.GenerateRequest) -> EnginePrompt:
    """The prompt's token ids: text tokenized as /v1/completions does, chat rendered as
    /v1/chat/completions does (without tools). Off the event loop: a long text takes long."""
    kind = req.WhichOneof("input")
    tokenizer = st.engine.tokenizer
    if kind == "text":
        return EnginePrompt(list(await asyncio.to_thread(tokenizer.encode, req.text)), req.text)
    if kind == "tokens":
        return EnginePrompt(list(req.tokens.ids), None)
    if kind == "chat":
        return EnginePrompt(await st.chat_prompt(_messages(req.chat), None, "chat"), None)
    raise APIError(400, "give the prompt as one of text, tokens or chat", "input", "invalid_value")


def _messages(chat: pb.Chat) -> list[dict[str, Any]]:
    if not chat.messages:
        raise bad("at least one message is needed", "chat.messages")
    for i, m in enumerate(chat.messages):
        if m.role not in ROLES:
            raise bad(f"role {m.role!r} is not one of {', '.join(ROLES)}", f"chat.messages.{i}.role")
    return [{"role": m.role, "content": m.content} for m in chat.messages]


def constraint_of(req: pb.GenerateRequest) -> StructuredOutputs | None:
    kind = req.WhichOneof("constraint")
    if kind is None:
        return None
    value = list(req.choice.values) if kind == "choice" else getattr(req, kind)
    try:
        spec = StructuredOutputs(**{kind: value}, field=kind)
        spec.check()  # the syntax, here where the field is known
    except ValueError as exc:
        raise bad(str(exc), kind) from None
    return spec


def token_limit(req: pb.GenerateRequest) -> int | None:
    s = req.sampling
    return s.max_tokens if s.HasField("max_tokens") else DEFAULT_MAX_TOKENS


def sampling_params(req: pb.GenerateRequest, max_tokens: int) -> SamplingParams:
    """Unset fields take /v1/completions' defaults; SamplingParams judges the values (its errors name the field)."""
    s = req.sampling
    if len(s.stop) > MAX_STOP:
        raise bad(f"at most {MAX_STOP} stop sequences, got {len(s.stop)}", "sampling.stop")

    def get(name: str, default: Any) -> Any:
        return getattr(s, name) if s.HasField(name) else default

    structured = constraint_of(req)
    try:
        return SamplingParams(
            temperature=get("temperature", 1.0), top_p=get("top_p", 1.0), top_k=get("top_k", 0),
            min_p=get("min_p", 0.0), repetition_penalty=get("repetition_penalty", 1.0),
            presence_penalty=get("presence_penalty", 0.0), frequency_penalty=get("frequency_penalty", 0.0),
            seed=get("seed", None), stop=list(s.stop) or None, stop_token_ids=list(s.stop_token_ids) or None,
            ignore_eos=s.ignore_eos, max_tokens=max_tokens, min_tokens=min(get("min_tokens", 0), max_tokens),
            structured=structured)
    except ValueError as exc:  # "top_p must be in (0, 1], got 0.0": the first word is the field
        field = str(exc).split(" ", 1)[0]
        raise APIError(400, f"sampling.{exc}", f"sampling.{field}", "invalid_value") from None


def finish_of(c: CompletionOutput) -> tuple[int, str]:
    """The finish reason, and the stop string that ended it (a stop token's id is not a string: none)."""
    reason = _FINISH.get(c.finish_reason, pb.FINISH_REASON_UNSPECIFIED) if c.finish_reason else \
        pb.FINISH_REASON_UNSPECIFIED
    return reason, c.stop_reason if isinstance(c.stop_reason, str) else ""


def usage_of(results: list[RequestOutput]) -> pb.Usage:
    prompt = sum(len(r.prompt_token_ids) for r in results)
    completion = sum(len(c.token_ids) for r in results for c in r.outputs)
    return pb.Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                    cached_tokens=sum(r.num_cached_tokens for r in results))
