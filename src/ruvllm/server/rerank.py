"""Rerank and score: `POST /v1/rerank` (also `/rerank` and `/v2/rerank`, the paths Jina's, Cohere's and
vLLM's clients call) and `POST /v1/score` (also `/score`). A query and documents (or two lists of texts)
become pairs, each pair one number for the engine to compute, all pairs of a call in the engine
at once; the engine is batch invariant, so a pair gets the same score in any company.

How a pair is scored is the server's `--score-mode` (ServerConfig.score_mode):
- `logits` (the default; the Qwen3-Reranker recipe): the pair is written into a yes/no question and
  rendered by the model's chat template; one greedy step reports the logprobs of the answer tokens at
  the next position (SamplingParams.logprob_token_ids), and the score is p(yes) / (p(yes) + p(no)).
- `embedding` (an embedding model served over the pooling path): the cosine of the two texts' vectors.

Neither is a completion: nothing streams and nothing is recorded (the witness log and the learner keep
completions), so a call runs here over the server's pieces as embeddings.py's does: admission, tenants
(their adapter and prefix-cache salt), the model name, metrics labelled by endpoint, OpenAI's error shape."""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Literal, TypeVar, Union

import numpy as np
from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, StrictBool, StrictInt, StrictStr

from ruvllm.engine.input_processor import check_embed_request, check_request
from ruvllm.errors import RequestError
from ruvllm.outputs import OutputKind, RequestOutput
from ruvllm.request import Priority
from ruvllm.sampling_params import SamplingParams
from ruvllm.server.errors import APIError
from ruvllm.server.generation import ServerState, state
from ruvllm.server.tenants import tenant_of

router = APIRouter()

MAX_PAIRS = 1000  # documents of one rerank call, pairs of one score call (Cohere's own advice for a call)

# The logit path's question. The Qwen3-Reranker layout (a judging system message; the instruction, query
# and document as tagged lines; the answer's first token read off the next position) in our own words,
# ending on the question itself: a small general chat model (the default SmolLM2-135M) orders an easy set
# sensibly with it, where without it its next token is prose whatever the document.
JUDGE_SYSTEM = ('Decide whether the document is relevant to the query, following the instruction. '
                'Answer only "yes" or "no".')
DEFAULT_INSTRUCTION = "Given a search query, find passages that answer it"
# Each answer counted in both casings: a trained reranker puts its mass on the lowercase words, a general
# chat model often starts its sentence with a capital; summed, neither loses the answer it meant.
YES_WORDS, NO_WORDS = ("yes", "Yes"), ("no", "No")

class RerankDocument(BaseModel):
    """A document as an object (Cohere's v1 and Jina's clients send these): its `text`; other fields ride along."""

    model_config = ConfigDict(extra="allow")
    text: StrictStr


class RerankRequest(BaseModel):
    """vLLM's, Jina's and Cohere's body (the fields they share). Unknown fields are ignored."""

    model_config = ConfigDict(extra="allow")
    model: str | None = None
    query: StrictStr
    documents: list[Union[StrictStr, RerankDocument]]
    top_n: StrictInt | None = None  # None: every document
    return_documents: StrictBool = True  # as vLLM and Jina; Cohere's clients say false
    instruction: StrictStr | None = None  # what "relevant" means here (vLLM's field); None: DEFAULT_INSTRUCTION
    user: str | None = None
    priority: Literal["low", "normal", "high", "critical"] | None = None  # ruvllm's, as on completions


class ScoreRequest(BaseModel):
    """vLLM's score body: each side a text or a list of texts (1:1, 1:N or N:N pairs)."""

    model_config = ConfigDict(extra="allow")
    model: str | None = None
    text_1: Union[StrictStr, list[StrictStr]]
    text_2: Union[StrictStr, list[StrictStr]]
    instruction: StrictStr | None = None
    user: str | None = None
    priority: Literal["low", "normal", "high", "critical"] | None = None


@dataclass(frozen=True)
class Scored:
    scores: list[float]  # one per pair, in the pairs' order
    prompt_tokens: int  # what the engine read for them


@router.post("/v1/rerank")
@router.post("/v2/rerank")
@router.post("/rerank")
async def rerank(body: RerankRequest, request: Request, st: ServerState = Depends(state)) -> Any:
    texts = [d if isinstance(d, str) else d.text for d in body.documents]
    _check_count(len(texts), "documents")
    if body.top_n is not None and body.top_n < 1:
        raise APIError(400, f"top_n must be at least 1, got {body.top_n} (leave it out for every document)", "top_n")
    call_id = st.admission.next_id("rerank-")
    scored = await _score(st, request, call_id, [(body.query, t) for t in texts], body.instruction, body.model,
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
    scored = await _score(st, request, call_id, _pairs(body.text_1, body.text_2), body.instruction, body.model,
                          body.user, body.priority, ("text_1", "text_2"))
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


# --- the call ------------------------------------------------------------------------------------------
async def _score(st: ServerState, request: Request, call_id: str, pairs: list[tuple[str, str]],
                 instruction: str | None, model: str | None, user: str | None, priority: str | None,
                 params: tuple[str, str]) -> Scored | None:
    """Every pair's score, the pairs in the engine together (their requests named `call_id-i`); None when
    the client left first. `params`: the body's fields for the pairs' two sides, named by a 400."""
    start = time.monotonic()
    tenant = tenant_of(request, user)
    adapter = st.check_model(model, tenant)
    rank = Priority[(priority or "normal").upper()]
    if st.cfg.score_mode == "embedding":
        scored = await _by_embedding(st, request, call_id, pairs, instruction, tenant, adapter, rank, params)
    else:
        scored = await _by_logits(st, request, call_id, pairs, instruction, tenant, adapter, rank, params[1])
    if scored is not None:
        st.metrics.e2e.labels(st.metrics.model, request.url.path).observe(time.monotonic() - start)
    return scored


async def _by_logits(st: ServerState, request: Request, call_id: str, pairs: list[tuple[str, str]],
                     instruction: str | None, tenant: str, adapter: str | None, priority: Priority,
                     param: str) -> Scored | None:
    yes, no = _answer_ids(st)
    sampling = SamplingParams(max_tokens=1, temperature=0.0, logprobs=0, logprob_token_ids=yes + no, ignore_eos=True)
    prompts = []
    for i, (query, document) in enumerate(pairs):
        ids = await _judgment(st, query, document, instruction or DEFAULT_INSTRUCTION, param)
        if len(ids) >= st.max_len:  # the answer needs one position more
            raise APIError(400, f"This model's maximum context length is {st.max_len} tokens, however pair {i} "
                                f"(its {param} item with the query and the question) has {len(ids)} tokens. "
                                f"Please shorten it.", param, "context_length_exceeded")
        check_request(ids, sampling, st.engine.info)
        prompts.append(ids)
    call = await _open(st, tenant, adapter)

    async def one(i: int, request_id: str) -> RequestOutput:
        async for out in st.engine.generate(prompts[i], sampling, request_id, priority, OutputKind.FINAL_ONLY,
                                            call.adapter, call.cache_salt, call.stacked):
            if out.finished:
                return out
        raise RequestError(f"pair {i} ended before it was judged", param)  # e.g. its adapter was unloaded

    outs = await _admitted(st, request, call_id, len(prompts), param, one)
    if outs is None:
        return None
    scores = []
    for out in outs:
        entry = (out.outputs[0].logprobs or [{}])[0]  # the one step's: its chosen token and every answer token
        scores.append(_yes_share([entry[t].logprob for t in yes], [entry[t].logprob for t in no]))
    _observe(st, request, [len(p) for p in prompts], [o.queue_time for o in outs])
    return Scored(scores, sum(map(len, prompts)))


async def _by_embedding(st: ServerState, request: Request, call_id: str, pairs: list[tuple[str, str]],
                        instruction: str | None, tenant: str, adapter: str | None, priority: Priority,
                        params: tuple[str, str]) -> Scored | None:
    """Each distinct text embedded once (a rerank's query is one input, not one per document); with an
    instruction, the query side is written as Qwen3-Embedding's queries are: `Instruct: ...\\nQuery: ...`."""
    lefts = [q if instruction is None else f"Instruct: {instruction}\nQuery: {q}" for q, _ in pairs]
    texts: dict[tuple[int, str], int] = {}  # (side, text) -> input index: the sides keep apart
    for side, items in enumerate((lefts, [d for _, d in pairs])):
        for text in items:
            texts.setdefault((side, text), len(texts))
    prompts = []
    for (side, text), _ in texts.items():
        ids = list(await asyncio.to_thread(st.engine.tokenizer.encode, text, add_special_tokens=True))
        param = params[side]
        if not ids:
            raise APIError(400, f"{param}: an empty text has no embedding", param)
        if len(ids) > st.max_len:
            raise APIError(400, f"This model's maximum context length is {st.max_len} tokens, however a {param} "
                                f"text has {len(ids)} tokens. Please shorten it.", param, "context_length_exceeded")
        check_embed_request(ids, st.engine.info)
        prompts.append(ids)
    call = await _open(st, tenant, adapter)

    async def one(i: int, request_id: str) -> Any:
        return await st.engine.embed(prompts[i], request_id, priority, call.adapter, call.cache_salt,
                                     stacked=call.stacked)

    outs = await _admitted(st, request, call_id, len(prompts), params[1], one)
    if outs is None:
        return None
    vectors = [np.asarray(o.embedding, dtype=np.float64) for o in outs]
    scores = [_cosine(vectors[texts[(0, left)]], vectors[texts[(1, d)]]) for left, (_, d) in zip(lefts, pairs)]
    _observe(st, request, [len(p) for p in prompts], [o.queue_time for o in outs])
    return Scored(scores, sum(map(len, prompts)))


async def _open(st: ServerState, tenant: str, adapter: str | None) -> Any:
    """The call decided by the generation service: the tenant's learned adapter where none is named, and
    its prefix-cache salt. Off the event loop with learning, as the service's own calls are."""
    args = ("", tenant, adapter, [], [])
    if st.service.learner is not None:
        return await asyncio.to_thread(st.service.open, *args)
    return st.service.open(*args)


T = TypeVar("T")


async def _admitted(st: ServerState, request: Request, call_id: str, n: int, param: str,
                    one: Callable[[int, str], Awaitable[T]]) -> list[T] | None:
    """`one(i, request_id)` for every input, at most the engine's running cap of them in it at once (so a
    large call waits for slots of its own rather than being refused), under admission; None when the
    client left first (every input is aborted)."""
    slots = min(n, st.engine.info.max_num_seqs)
    st.admission.acquire(slots, param)
    gate = asyncio.Semaphore(slots)

    async def gated(i: int) -> T:
        async with gate:
            return await one(i, f"{call_id}-{i}")

    async def every() -> list[T]:
        return list(await asyncio.gather(*(gated(i) for i in range(n))))  # cancelled: every input is aborted

    task = asyncio.create_task(every())
    try:
        while not task.done():
            await asyncio.wait({task}, timeout=0.25)
            if not task.done() and await request.is_disconnected():
                return None
        return task.result()  # raises what the engine raised
    finally:
        if not task.done():  # the client is gone, or this wait was cancelled: every input is aborted
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        st.admission.release(slots)


def _observe(st: ServerState, request: Request, prompt_lengths: list[int], queue_times: list[float | None]) -> None:
    labels = (st.metrics.model, request.url.path)
    m = st.metrics
    m.prompt_tokens.labels(*labels).inc(sum(prompt_lengths))
    m.request_success.labels(*labels, "stop").inc(len(prompt_lengths))
    for q in queue_times:
        if q is not None:
            m.queue_time.labels(*labels).observe(q)


# --- the logit path's pieces ---------------------------------------------------------------------------
def _answer_ids(st: ServerState) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The answer words that are one token in this vocabulary (a word of several tokens has no probability
    at one position)."""
    tok = st.engine.tokenizer

    def single(words: tuple[str, ...]) -> tuple[int, ...]:
        ids = [tok.encode(w, add_special_tokens=False) for w in words]
        return tuple(dict.fromkeys(x[0] for x in ids if len(x) == 1))

    yes, no = single(YES_WORDS), single(NO_WORDS)
    if not yes or not no or set(yes) & set(no):
        raise APIError(400, "this model's vocabulary has no single token for the answers yes and no, so it cannot "
                            "judge pairs by its logits; serve it with --score-mode embedding", "model")
    return yes, no


async def _judgment(st: ServerState, query: str, document: str, instruction: str, param: str) -> list[int]:
    """The question, rendered by the chat template. `enable_thinking: false` gives a thinking template's
    empty reasoning block (Qwen3's, which Qwen3-Reranker was trained behind); other templates ignore it."""
    messages = [{"role": "system", "content": JUDGE_SYSTEM},
                {"role": "user", "content": f"<Instruct>: {instruction}\n<Query>: {query}\n<Document>: {document}\n"
                                            "Is the document relevant to the query?"}]
    return await st.chat_prompt(messages, param=param, variables={"enable_thinking": False})


def _yes_share(yes: list[float], no: list[float]) -> float:
    """p(yes) / (p(yes) + p(no)) from logprobs, as a logistic of the log-odds (no overflow, no 0/0)."""
    odds = _logsumexp(yes) - _logsumexp(no)
    if math.isnan(odds):  # both -inf: the model gives neither answer any mass
        return 0.5
    return 1.0 / (1.0 + math.exp(-odds)) if odds >= 0 else math.exp(odds) / (1.0 + math.exp(odds))


def _logsumexp(values: list[float]) -> float:
    top = max(values)
    if top == -math.inf:
        return top
    return top + math.log(sum(math.exp(v - top) for v in values))


def _cosine(a: np.ndarray, b: np.ndarray) -> float:
    norms = float(np.linalg.norm(a) * np.linalg.norm(b))
    return float(np.dot(a, b) / norms) if norms > 0 else 0.0
