"""A user request turned into the core's self-contained sequences, checked once, in the front."""

from __future__ import annotations

import dataclasses
import time
from typing import Any

from ruvllm.config import POOLING_METHODS
from ruvllm.errors import RequestError
from ruvllm.messages import CoreRequest, EngineInfo
from ruvllm.request import Priority
from ruvllm.sampling_params import SamplingParams


def stop_token_set(info: EngineInfo, tokenizer: Any) -> tuple[int, ...]:
    """EOS ids: the model's, and the tokenizer's (they disagree in some checkpoints)."""
    ids = set(info.eos_token_ids)
    if getattr(tokenizer, "eos_token_id", None) is not None:
        ids.add(tokenizer.eos_token_id)
    return tuple(sorted(ids))


def check_request(ids: list[int], params: SamplingParams, info: EngineInfo) -> None:
    """What a request brings that SamplingParams cannot judge alone (it needs the model's numbers).
    Checked before anything reaches the core: a step that a request's values broke would fail every
    request in it."""
    if not ids:
        raise RequestError("prompt is empty: at least one token is needed", "prompt")
    vocab = info.vocab_size
    bad = [t for t in ids if not isinstance(t, int) or not 0 <= t < vocab]
    if bad:
        raise RequestError(f"prompt token ids out of range [0, {vocab}): {bad[:5]}", "prompt")
    if len(ids) >= info.max_seq_len:
        raise RequestError(f"prompt has {len(ids)} tokens, but this engine's context holds at most "
                           f"{info.max_seq_len} tokens (prompt plus at least one generated token)", "prompt")
    if params.top_k > vocab:
        raise RequestError(f"top_k must be -1 (off) or at most the vocabulary size ({vocab}), "
                           f"got {params.top_k}", "top_k")
    for field_name, tids in (("logit_bias", list((params.logit_bias or {}).keys())),
                             ("stop_token_ids", list(params.stop_token_ids or [])),
                             ("logprob_token_ids", list(params.logprob_token_ids or []))):
        for tid in tids:
            if not 0 <= tid < vocab:
                raise RequestError(f"token id {tid} is outside the vocabulary [0, {vocab})", field_name)
    if params.structured is not None:
        try:  # the syntax, here: the core compiles it against the vocabulary beside its loop
            params.structured.check()
        except ValueError as exc:
            raise RequestError(str(exc), "structured") from None


def child_ids(request_id: str, n: int) -> list[str]:
    return [f"{request_id}#{i}" for i in range(n)] if n > 1 else [request_id]


def core_requests(request_id: str, ids: list[int], params: SamplingParams, priority: Priority,
                  info: EngineInfo, eos_token_ids: tuple[int, ...], adapter: str | None = None,
                  cache_salt: str | None = None, stacked: tuple[str, ...] = ()) -> list[CoreRequest]:
    """One CoreRequest per completion: n > 1 becomes n sequences over the same prompt, each with
    its own seed (seed + i, wrapping in the generator's 64-bit range) when the request has one.
    `stacked`: adapters whose deltas are added after `adapter`'s (its tenant's micro-LoRA)."""
    check_request(ids, params, info)
    now = time.monotonic()
    out = []
    for i, cid in enumerate(child_ids(request_id, params.n)):
        p = params
        if params.n > 1:
            seed = None if params.seed is None else (params.seed + i) % 2**64
            p = dataclasses.replace(params, n=1, seed=seed)
        out.append(CoreRequest(cid, list(ids), p, eos_token_ids, int(priority), now,
                               prompt_sibling=out[0].request_id if out else None, adapter=adapter,
                               cache_salt=cache_salt, stacked=stacked if adapter is not None else ()))
    return out


def check_embed_request(ids: list[int], info: EngineInfo, pooling: str | None = None) -> None:
    """An embedding's input, judged before it reaches the core: non-empty, in the vocabulary, within
    the context (it needs no room for a generated token: its whole input may fill it)."""
    if not ids:
        raise RequestError("input is empty: at least one token is needed", "input")
    vocab = info.vocab_size
    bad = [t for t in ids if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab]
    if bad:
        raise RequestError(f"input token ids out of range [0, {vocab}): {bad[:5]}", "input")
    if len(ids) > info.max_seq_len:
        raise RequestError(f"input has {len(ids)} tokens, but this engine's context holds at most "
                           f"{info.max_seq_len} tokens", "input")
    if pooling is not None and pooling not in POOLING_METHODS:
        raise RequestError(f"pooling must be one of {', '.join(POOLING_METHODS)}, got {pooling!r}", "pooling")


def embed_request(request_id: str, ids: list[int], priority: Priority, info: EngineInfo,
                  pooling: str | None = None, adapter: str | None = None,
                  cache_salt: str | None = None, stacked: tuple[str, ...] = ()) -> CoreRequest:
    """One embedding for the core: prefill only, pooled as `pooling` says (None: the engine's)."""
    check_embed_request(ids, info, pooling)
    # (its SamplingParams are never read: nothing is sampled)
    return CoreRequest(request_id, list(ids), SamplingParams(max_tokens=1), (), int(priority), time.monotonic(),
                       adapter=adapter, cache_salt=cache_salt, pooling=pooling or info.pooling,
                       stacked=stacked if adapter is not None else ())
