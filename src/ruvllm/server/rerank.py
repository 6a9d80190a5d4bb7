"""Rerank and score: `POST /v1/rerank` (also `/rerank` and `/v2/rerank`, the paths Jina's, Cohere's and
vLLM's clients call) and `POST /v1/score` (also `/score`). A query and documents (or two lists of texts)
become pairs, each pair one number, scored by rerank_scoring.py as the server's `--score-mode` says
(a yes/no judgment's logits, or embedding cosine); bodies in rerank_protocol.py.

A call runs over the server's pieces as embeddings.py's does: admission, tenants (their adapter and
prefix-cache salt), the model name, metrics labelled by endpoint, OpenAI's error shape."""

from __future__ import annotations

import time
from typing import Any, Union

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response

from ruvllm.server.errors import APIError
from ruvllm.server.generation import ServerState, state
from ruvllm.server.rerank_protocol import RerankRequest, ScoreRequest
from ruvllm.server.rerank_scoring import Scored, score_pairs

router = APIRouter()

MAX_PAIRS = 1000  # documents of one rerank call, pairs of one score call (Cohere's own advice for a call)


@router.post("/v1/rerank")
@router.post("/v2/rerank")
@router.post("/rerank")
async def rerank(body: RerankRequest, request: Request, st: ServerState = Depends(state)) -> Any:
    texts = [d if isinstance(d, str) else d.text for d in body.documents]
    _check_count(len(texts), "documents")
    if body.top_n is not None and body.top_n < 1:
        raise APIError(400, f"top_n must be at least 1, got {body.top_n} (leave it out for every document)", "top_n")
    call_id = st.admission.next_id("rerank-")
    scored = await score_pairs(st, request, call_id, [(body.query, t) for t in texts], body.instruction, body.model,
                               body.user, body.priority, ("query", "documents"))
    if scored is None:
        return Response(status_code=499)  # the client left; nobody reads this
    order = sorted(range(len(texts)), key=lambda i: -scored.scores[i])  # stable: ties keep the documents' order
    results = []
    for i in order[:body.top_n]:
        result: dict[str, Any] = {"index": i, "relevance_score": scored.scores[i]}
        if body.return_documents:
            result["document"] = {"text": texts[i]}
        results.append(result)
    return {"id": call_id, "model": body.model or st.cfg.served_model_name,
            "results": results, "usage": _usage(scored)}


@router.post("/v1/score")
@router.post("/score")
async def score(body: ScoreRequest, request: Request, st: ServerState = Depends(state)) -> Any:
    call_id = st.admission.next_id("score-")
    scored = await score_pairs(st, request, call_id, _pairs(body.text_1, body.text_2), body.instruction,
                               body.model, body.user, body.priority, ("text_1", "text_2"))
    if scored is None:
        return Response(status_code=499)
    return {"id": call_id, "object": "list", "created": int(time.time()),
            "model": body.model or st.cfg.served_model_name,
            "data": [{"index": i, "object": "score", "score": s} for i, s in enumerate(scored.scores)],
            "usage": _usage(scored)}


# --- pairs ---------------------------------------------------------------------------------------------
def _check_count(n: int, param: str) -> None:
    if n == 0:
        raise APIError(400, f"{param} must not be empty", param)
    if n > MAX_PAIRS:
        raise APIError(400, f"{param} has {n} items; at most {MAX_PAIRS} are scored in one call", param)


def _pairs(text_1: Union[str, list[str]], text_2: Union[str, list[str]]) -> list[tuple[str, str]]:
    """1:1, 1:N (one text against each of the others) or N:N (position by position), as vLLM pairs them."""
    left = [text_1] if isinstance(text_1, str) else list(text_1)
    right = [text_2] if isinstance(text_2, str) else list(text_2)
    _check_count(len(left), "text_1")
    _check_count(len(right), "text_2")
    if len(left) == 1:
        return [(left[0], r) for r in right]
    if len(left) != len(right):
        raise APIError(400, f"text_1 has {len(left)} texts and text_2 {len(right)}: give one text_1 for every "
                            "text_2, or as many of each (they are paired by position)", "text_2")
    return list(zip(left, right))


def _usage(scored: Scored) -> dict[str, int]:
    return {"prompt_tokens": scored.prompt_tokens, "total_tokens": scored.prompt_tokens}
