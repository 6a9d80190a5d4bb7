"""Rerank and score (server/rerank.py) through plain HTTP: no official client exists for these routes, so
the wire shape checked here is the one vLLM's, Jina's and Cohere's clients parse. The logit path on the
default model: an easy query orders its documents sensibly, and every document scores in a batch exactly
as it scores alone (the engine is batch invariant). The embedding path on a server with
`score_mode="embedding"`: the cosine of the offline engine's vectors."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import numpy as np
import pytest

from ruvllm import LLM
from ruvllm.sampling_params import SamplingParams
from ruvllm.server.rerank import MAX_PAIRS
from tests.server.conftest import MODEL, RunningServer, start_server

QUERY = "What is the capital of France?"
RELEVANT = ["Paris is the capital of France.", "Paris, the capital city of France, lies on the Seine."]
IRRELEVANT = ["Bananas are a yellow fruit.", "The mitochondria is the powerhouse of the cell."]
DOCS = [IRRELEVANT[0], RELEVANT[0], IRRELEVANT[1], RELEVANT[1]]


def _rerank(http: httpx.Client, path: str = "/v1/rerank", **body) -> dict:
    r = http.post(path, json={"model": MODEL, **body})
    assert r.status_code == 200, r.text
    return r.json()


def _scores(body: dict) -> dict[int, float]:
    return {res["index"]: res["relevance_score"] for res in body["results"]}


@pytest.fixture(scope="module")
def batch_scores(server: RunningServer) -> dict[int, float]:
    """DOCS reranked in one call (their four judgments in the engine together)."""
    with httpx.Client(base_url=server.url, timeout=60) as http:
        return _scores(_rerank(http, query=QUERY, documents=DOCS))


def test_rerank_orders_an_easy_set_and_each_document_scores_as_alone(http: httpx.Client,
                                                                       batch_scores: dict[int, float]) -> None:
    body = _rerank(http, query=QUERY, documents=DOCS)
    assert body["id"].startswith("rerank-") and body["model"] == MODEL
    results = body["results"]
    assert [set(r) for r in results] == [{"index", "relevance_score", "document"}] * 4
    assert [r["document"]["text"] for r in results] == [DOCS[r["index"]] for r in results]
    values = [r["relevance_score"] for r in results]
    assert values == sorted(values, reverse=True) and all(0.0 < v < 1.0 for v in values)
    # Both relevant documents above both irrelevant ones
    assert {r["index"] for r in results[:2]} == {1, 3}, results
    assert _scores(body) == batch_scores  # the same call again: the same numbers
    for i, doc in enumerate(DOCS):  # each alone: bit for bit what it got beside the others
        assert _scores(_rerank(http, query=QUERY, documents=[doc])) == {0: batch_scores[i]}
    usage = body["usage"]
    assert usage["prompt_tokens"] == usage["total_tokens"] > 4 * len(QUERY.split())


def test_top_n_document_objects_and_the_three_paths(http: httpx.Client, batch_scores: dict[int, float]) -> None:
    best = max(batch_scores, key=batch_scores.__getitem__)
    for path in ("/v1/rerank", "/rerank", "/v2/rerank"):
        body = _rerank(http, path, query=QUERY, documents=[{"text": d, "id": f"doc{i}"} for i, d in enumerate(DOCS)],
                       top_n=1, return_documents=False)
        assert body["results"] == [{"index": best, "relevance_score": batch_scores[best]}], path
    body = _rerank(http, query=QUERY, documents=DOCS, top_n=10)  # more than there are: every document
    assert _scores(body) == batch_scores


def test_score_pairs_one_to_one_one_to_many_and_many_to_many(http: httpx.Client,
                                                             batch_scores: dict[int, float]) -> None:
    def score(path: str = "/v1/score", **body) -> list[float]:
        r = http.post(path, json={"model": MODEL, **body})
        assert r.status_code == 200, r.text
        out = r.json()
        assert out["object"] == "list" and out["id"].startswith("score-") and out["model"] == MODEL
        assert out["usage"]["prompt_tokens"] == out["usage"]["total_tokens"] > 0
        assert [d["index"] for d in out["data"]] == list(range(len(out["data"])))
        assert all(d["object"] == "score" for d in out["data"])
        return [d["score"] for d in out["data"]]

    assert score(text_1=QUERY, text_2=DOCS[1]) == [batch_scores[1]]
    assert score("/score", text_1=[QUERY], text_2=DOCS) == [batch_scores[i] for i in range(4)]
    assert score(text_1=QUERY, text_2=DOCS[:2]) == [batch_scores[0], batch_scores[1]]
    # N:N pairs by position: the second pair's first text differs, and so does its score
    other = "Which fruit is yellow?"
    pairwise = score(text_1=[QUERY, other], text_2=[DOCS[1], DOCS[0]])
    assert pairwise[0] == batch_scores[1]
    assert pairwise[1] == score(text_1=other, text_2=DOCS[0])[0]


def test_an_instruction_reaches_the_judgment(http: httpx.Client, batch_scores: dict[int, float]) -> None:
    body = _rerank(http, query=QUERY, documents=DOCS[:1], instruction="Judge whether the passage is about fruit")
    assert _scores(body)[0] != batch_scores[0]


@pytest.mark.parametrize("path,body,param", [
    ("/v1/rerank", {"query": QUERY, "documents": []}, "documents"),
    ("/v1/rerank", {"query": QUERY, "documents": ["x"] * (MAX_PAIRS + 1)}, "documents"),
    ("/v1/rerank", {"query": QUERY, "documents": DOCS, "top_n": 0}, "top_n"),
    ("/v2/rerank", {"query": QUERY, "documents": DOCS, "top_n": "2"}, "top_n"),
    ("/v1/rerank", {"query": QUERY, "documents": [1, 2]}, "documents.0"),
    ("/v1/rerank", {"query": QUERY, "documents": [{"title": "no text"}]}, "documents.0"),
    ("/rerank", {"query": 7, "documents": DOCS}, "query"),
    ("/v1/rerank", {"documents": DOCS}, "query"),
    ("/v1/rerank", {"query": QUERY, "documents": DOCS, "return_documents": "yes"}, "return_documents"),
    ("/v1/score", {"text_1": [QUERY, QUERY], "text_2": DOCS}, "text_2"),
    ("/v1/score", {"text_1": [], "text_2": DOCS}, "text_1"),
    ("/score", {"text_1": QUERY, "text_2": []}, "text_2"),
    ("/v1/score", {"text_1": QUERY, "text_2": [3]}, "text_2"),
    ("/v1/score", {"text_1": QUERY, "text_2": ["x"] * (MAX_PAIRS + 1)}, "text_2"),
    ("/v1/rerank", {"query": "long " * 9000, "documents": DOCS[:1]}, "documents"),
])
def test_bad_input_is_a_400_naming_the_field(http: httpx.Client, path: str, body: dict, param: str) -> None:
    r = http.post(path, json={"model": MODEL, **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error" and err["message"], err


def test_an_unknown_model_is_a_404_and_the_metrics_name_the_endpoint(http: httpx.Client,
                                                                     batch_scores: dict[int, float]) -> None:
    r = http.post("/v1/rerank", json={"model": "nope", "query": QUERY, "documents": DOCS})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    assert http.post("/v1/score", json={"model": MODEL, "text_1": QUERY, "text_2": DOCS[1]}).status_code == 200
    metrics = http.get("/metrics").text
    for endpoint in ("/v1/rerank", "/v1/score"):
        assert f'ruvllm:prompt_tokens_total{{endpoint="{endpoint}",model_name="{MODEL}"}}' in metrics
        assert f'ruvllm:e2e_request_latency_seconds_count{{endpoint="{endpoint}",model_name="{MODEL}"}}' in metrics
        assert f'ruvllm:request_success_total{{endpoint="{endpoint}",finished_reason="stop",model_name="{MODEL}"}}' \
            in metrics


def test_logprob_token_ids_need_logprobs() -> None:
    with pytest.raises(ValueError, match="logprob_token_ids"):
        SamplingParams(max_tokens=1, logprob_token_ids=(1, 2))
    with pytest.raises(ValueError, match="logprob_token_ids"):
        SamplingParams(max_tokens=1, logprobs=0, logprob_token_ids=(-1,))


# --- the embedding path ---------------------------------------------------------------------------------
KEY = "rerank-test-key"


@pytest.fixture(scope="module")
def embedding_server(_shared_llm: LLM) -> Iterator[RunningServer]:
    """Scores by embedding cosine, behind an API key."""
    yield from start_server(_shared_llm, score_mode="embedding", api_key=KEY)


def test_embedding_mode_scores_the_cosine_of_the_vectors(embedding_server: RunningServer, _shared_llm: LLM) -> None:
    with httpx.Client(base_url=embedding_server.url, timeout=60) as anonymous:
        for path in ("/v1/rerank", "/v1/score"):  # the key guards these routes as every other
            r = anonymous.post(path, json={"query": QUERY, "documents": DOCS, "text_1": QUERY, "text_2": DOCS})
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", r.text
    with httpx.Client(base_url=embedding_server.url, timeout=60, headers={"Authorization": f"Bearer {KEY}"}) as http:
        body = _rerank(http, query=QUERY, documents=DOCS)
        alone = _scores(_rerank(http, query=QUERY, documents=[DOCS[2]]))
        r = http.post("/v1/score", json={"model": MODEL, "text_1": [QUERY, DOCS[0]], "text_2": [DOCS[1], DOCS[0]]})
        assert r.status_code == 200, r.text
        pairwise = [d["score"] for d in r.json()["data"]]
    vectors = [np.asarray(o.embedding, dtype=np.float64) for o in _shared_llm.embed([QUERY, *DOCS])]

    def cosine(a: np.ndarray, b: np.ndarray) -> float:
        return float(np.dot(a, b) / (np.linalg.norm(a) * np.linalg.norm(b)))

    expected = {i: cosine(vectors[0], vectors[1 + i]) for i in range(4)}
    assert _scores(body) == expected
    assert [r["relevance_score"] for r in body["results"]] == sorted(expected.values(), reverse=True)
    assert alone == {0: expected[2]}
    assert pairwise[0] == expected[1] and pairwise[1] == pytest.approx(1.0, abs=1e-6)  # a text with itself
    stats = embedding_server.wait_idle()
    assert stats.free_blocks == stats.total_blocks
