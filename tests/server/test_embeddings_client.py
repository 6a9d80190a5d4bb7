"""Embeddings through the official clients: the `openai` SDK's `embeddings.create` (floats, base64 as
the SDK asks for it by default, `dimensions`, token-id inputs) and the `ollama` client's `embed`
and `embeddings`; each dialect's bad input gets its own error shape and a 4xx."""

from __future__ import annotations

import base64

import numpy as np
import ollama
import openai
import pytest

from ruvllm import LLM
from tests.server.conftest import MODEL, RunningServer

# Short on purpose (the fp32 model costs ~10 ms a token on one CPU thread): these tests check the
# translation of each dialect; the vectors' correctness and invariance are tests/e2e/test_embeddings.py's.
TEXTS = ["The quick brown fox.", "Paris is in France.", "Text to vectors."]


@pytest.fixture
def client(server: RunningServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture
def olla(server: RunningServer) -> ollama.Client:
    return ollama.Client(host=server.url)


def _floats(client: openai.OpenAI, inputs, **kw) -> list[list[float]]:
    r = client.embeddings.create(model=MODEL, input=inputs, encoding_format="float", **kw)
    return [d.embedding for d in sorted(r.data, key=lambda d: d.index)]


def test_openai_float_base64_and_the_sdk_default_agree(client: openai.OpenAI, _shared_llm: LLM) -> None:
    r = client.embeddings.create(model=MODEL, input=TEXTS, encoding_format="float")
    assert r.object == "list" and r.model == MODEL and [d.index for d in r.data] == [0, 1, 2]
    floats = [d.embedding for d in r.data]
    hidden = _shared_llm.info.hidden_size
    assert all(len(v) == hidden and abs(np.linalg.norm(v) - 1) < 1e-5 for v in floats)
    ids = [_shared_llm.tokenizer.encode(t) for t in TEXTS]
    assert r.usage.prompt_tokens == r.usage.total_tokens == sum(map(len, ids))
    # The SDK asks for base64 when no format is given, and decodes it into floats itself.
    default = client.embeddings.create(model=MODEL, input=TEXTS)
    assert [d.embedding for d in default.data] == floats
    raw = client.embeddings.create(model=MODEL, input=TEXTS, encoding_format="base64")
    decoded = [np.frombuffer(base64.b64decode(d.embedding), dtype="<f4").tolist() for d in raw.data]
    assert decoded == floats
    # The same vectors as the offline engine over the same weights, bit for bit.
    assert [o.embedding for o in _shared_llm.embed(TEXTS)] == floats


def test_token_id_inputs_equal_text_inputs(client: openai.OpenAI, _shared_llm: LLM) -> None:
    ids = [_shared_llm.tokenizer.encode(t) for t in TEXTS[:2]]
    text = _floats(client, TEXTS[:2])
    assert _floats(client, ids[0]) == text[:1]
    assert _floats(client, ids) == text


def test_dimensions_truncate_then_renormalize(client: openai.OpenAI) -> None:
    full = np.asarray(_floats(client, TEXTS[0])[0], dtype=np.float32)
    short = np.asarray(_floats(client, TEXTS[0], dimensions=64)[0], dtype=np.float32)
    assert short.shape == (64,) and abs(np.linalg.norm(short) - 1) < 1e-5
    np.testing.assert_allclose(short, full[:64] / np.linalg.norm(full[:64]), rtol=1e-5, atol=1e-7)


def test_served_while_a_stream_runs(client: openai.OpenAI, _shared_llm: LLM) -> None:
    """What is HTTP's own: an embeddings call answered while a completion stream is open on the same
    server. (That a batch, chunks and running generation leave every vector as it is alone is the
    engine's, tested in tests/e2e/test_embeddings.py; here it was 3 streams and 4 calls, ~3.4 s.)"""
    stream = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=8, stream=True,
                                       temperature=0, extra_body={"ignore_eos": True})
    chunks = iter(stream)
    next(chunks)  # the generation runs: 7 more decode steps, the embeddings' one step among them
    served = _floats(client, TEXTS)
    rest = list(chunks)
    assert rest[-1].choices[0].finish_reason == "length"
    assert served == [o.embedding for o in _shared_llm.embed(TEXTS)]  # the offline engine, after the stream


def test_openai_bad_input_is_a_400_in_openai_shape(client: openai.OpenAI, _shared_llm: LLM) -> None:
    info = _shared_llm.info
    cases = [dict(input=[]), dict(input=""), dict(input=[[1, 2], []]), dict(input=[1, info.vocab_size]),
             dict(input=[-1]), dict(input="hi", dimensions=0), dict(input="hi", dimensions=info.hidden_size + 1),
             dict(input="hi", encoding_format="int8"), dict(input=[1] * (info.max_seq_len + 1))]
    for kw in cases:
        with pytest.raises(openai.BadRequestError) as e:
            client.embeddings.create(model=MODEL, **kw)
        assert e.value.status_code == 400, kw
        assert e.value.body["type"] == "invalid_request_error" and e.value.body["message"], kw
    assert e.value.code == "context_length_exceeded"  # the last case's
    with pytest.raises(openai.NotFoundError):
        client.embeddings.create(model="no-such-model", input="hi")


def test_ollama_embed_and_the_older_embeddings(olla: ollama.Client, client: openai.OpenAI) -> None:
    r = olla.embed(model=MODEL, input=TEXTS)
    assert r.model == MODEL and len(r.embeddings) == 3
    assert [list(v) for v in r.embeddings] == _floats(client, TEXTS)
    assert r.prompt_eval_count and r.prompt_eval_count > 0 and r.total_duration and r.total_duration > 0
    one = olla.embed(model=MODEL + ":latest", input=TEXTS[0], dimensions=32)
    assert len(one.embeddings) == 1 and len(one.embeddings[0]) == 32
    assert abs(np.linalg.norm(one.embeddings[0]) - 1) < 1e-5
    old = olla.embeddings(model=MODEL, prompt=TEXTS[1])
    assert list(old.embedding) == list(r.embeddings[1])
    # As Ollama: no input embeds nothing (it only loads the model).
    assert olla.embed(model=MODEL, input=[]).embeddings == []


def test_ollama_truncates_to_the_context_unless_told_not_to(olla: ollama.Client, client: openai.OpenAI,
                                                            _shared_llm: LLM) -> None:
    text = " ".join(TEXTS * 3)
    ids = _shared_llm.tokenizer.encode(text)
    assert len(ids) > 24
    cut = olla.embed(model=MODEL, input=text, options={"num_ctx": 24})
    assert list(cut.embeddings[0]) == _floats(client, ids[:24])[0]
    assert cut.prompt_eval_count == 24
    with pytest.raises(ollama.ResponseError) as e:
        olla.embed(model=MODEL, input=text, truncate=False, options={"num_ctx": 24})
    assert e.value.status_code == 400 and "context length" in e.value.error


def test_ollama_bad_input_is_a_400_in_ollama_shape(server: RunningServer, olla: ollama.Client) -> None:
    import httpx

    with httpx.Client(base_url=server.url, timeout=30) as http:
        for body in ({"model": MODEL, "input": 5}, {"input": "hi"}, {"model": MODEL, "input": ["hi", ""]},
                     {"model": MODEL, "input": "hi", "dimensions": 0}):
            r = http.post("/api/embed", json=body)
            assert r.status_code == 400, body
            assert set(r.json()) == {"error"} and r.json()["error"], body
    with pytest.raises(ollama.ResponseError) as e:
        olla.embed(model="no-such-model", input="hi")
    assert e.value.status_code == 404


def test_tenants_share_no_cached_blocks(client: openai.OpenAI, server: RunningServer) -> None:
    """`user` names the tenant, as on chat completions: its prefix-cache salt keeps another tenant
    from hitting (and so timing) its cached blocks; the same tenant hits them."""
    text = " ".join(TEXTS * 4)  # several full blocks

    def hits_after(user: str) -> int:
        before = server.engine.stats().prefix_hits
        client.embeddings.create(model=MODEL, input=text, user=user, encoding_format="float")
        return server.engine.stats().prefix_hits - before

    hits_after("alice")
    assert hits_after("alice") > 0
    assert hits_after("bob") == 0
