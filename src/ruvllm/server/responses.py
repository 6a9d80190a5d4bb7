"""Engine outputs -> OpenAI response bodies (chat, completions, streaming chunks), to the letter of
OpenAI's published schema: nullable-but-required fields (`logprobs`, `message.refusal`) are present."""

from __future__ import annotations

import time
import uuid
from typing import Any

from ruvllm.request import Logprob


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
