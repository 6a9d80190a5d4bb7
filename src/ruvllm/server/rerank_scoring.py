"""How a rerank or score call's pairs are scored (the service behind server/rerank.py's routes), by the
server's `--score-mode` (ServerConfig.score_mode):
- `logits` (the default; the Qwen3-Reranker recipe): the pair is written into a yes/no question and
  rendered by the model's chat template; one greedy step reports the logprobs of the answer tokens at
  the next position (SamplingParams.logprob_token_ids), and the score is p(yes) / (p(yes) + p(no)).
- `embedding` (an embedding model served over the pooling path): the cosine of the two texts' vectors.

Every pair of a call is in the engine at once (under admission, at most its running cap), each one
request named `call_id-i`; the engine is batch invariant, so a pair gets the same score in any company.
Neither is a completion: nothing streams and nothing is recorded (the witness log and the learner keep
completions). The call is decided as a generation call is (tenant, adapter, prefix-cache salt)."""

from __future__ import annotations

import asyncio
import math
import time
from dataclasses import dataclass

import numpy as np
from fastapi import Request

from ruvllm.engine.input_processor import check_embed_request, check_request
from ruvllm.errors import RequestError
from ruvllm.outputs import OutputKind, RequestOutput
from ruvllm.request import Priority
from ruvllm.sampling_params import SamplingParams
from ruvllm.server.errors import APIError
from ruvllm.server.generation import ServerState
from ruvllm.server.tenants import tenant_of

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


@dataclass(frozen=True)
class Scored:
    scores: list[float]  # one per pair, in the pairs' order
    prompt_lengths: list[int]  # what the engine read for them, input by input
    queue_times: list[float | None]  # each input's wait before it was first scheduled

    @property
    def prompt_tokens(self) -> int:
        return sum(self.prompt_lengths)


async def score_pairs(st: ServerState, request: Request, call_id: str, pairs: list[tuple[str, str]],
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
        st.metrics.pooled(request.url.path, scored.prompt_lengths, scored.queue_times, time.monotonic() - start)
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
    args = ("", tenant, adapter, [], [])  # decided off the event loop with learning, as the service's own calls are
    call = await asyncio.to_thread(st.service.open, *args) if st.service.learner is not None else st.service.open(*args)

    async def one(i: int) -> RequestOutput:
        async for out in st.engine.generate(prompts[i], sampling, f"{call_id}-{i}", priority, OutputKind.FINAL_ONLY,
                                            call.adapter, call.cache_salt, call.stacked):
            if out.finished:
                return out
        raise RequestError(f"pair {i} ended before it was judged", param)  # e.g. its adapter was unloaded

    async def every(slots: int) -> list[RequestOutput]:
        gate = asyncio.Semaphore(slots)

        async def gated(i: int) -> RequestOutput:
            async with gate:
                return await one(i)

        return list(await asyncio.gather(*(gated(i) for i in range(len(prompts)))))  # cancelled: every one aborted

    outs = await st.admitted(request, len(prompts), param, every)
    if outs is None:
        return None
    scores = []
    for out in outs:
        entry = (out.outputs[0].logprobs or [{}])[0]  # the one step's: its chosen token and every answer token
        scores.append(_yes_share([entry[t].logprob for t in yes], [entry[t].logprob for t in no]))
    return Scored(scores, [len(p) for p in prompts], [o.queue_time for o in outs])


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
    outs = await st.admitted(request, len(prompts), params[1], lambda slots: st.service.embed(
        st.engine, call_id, tenant, adapter, prompts, priority, concurrency=slots))
    if outs is None:
        return None
    vectors = [np.asarray(o.embedding, dtype=np.float64) for o in outs]
    scores = [_cosine(vectors[texts[(0, left)]], vectors[texts[(1, d)]]) for left, (_, d) in zip(lefts, pairs)]
    return Scored(scores, [len(p) for p in prompts], [o.queue_time for o in outs])


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
