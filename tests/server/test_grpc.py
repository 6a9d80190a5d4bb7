"""The gRPC API (src/ruvllm/grpc/ruvllm.proto) through a client generated from the .proto (grpc's own
stubs, GenerationStub), against the server started as `ruvllm serve --grpc-port` starts it: in the
app's lifespan, on the HTTP server's event loop, over the same engine and generation service."""

from __future__ import annotations

import filecmp
import json
import os
import re
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import pytest

from ruvllm import LLM
from ruvllm.grpc import ruvllm_pb2 as pb
from ruvllm.grpc.ruvllm_pb2_grpc import GenerationStub
from ruvllm.grpc.translate import sampling_params
from ruvllm.server.config import RayServeConfig, ServerConfig
from ruvllm.structured.spec import StructuredOutputs
from tests.server.conftest import MODEL, RunningServer, free_port, start_server

ROOT = Path(__file__).resolve().parents[2]
PROMPT = "The capital of France is"
GREEDY = pb.SamplingOptions(max_tokens=12, temperature=0)


@pytest.fixture(scope="module")
def server(_shared_llm: LLM) -> Iterator[RunningServer]:
    yield from start_server(_shared_llm, grpc_port=free_port())


@pytest.fixture(scope="module")
def stub(server: RunningServer) -> Iterator[GenerationStub]:
    with grpc.insecure_channel(f"127.0.0.1:{server.app.state.grpc_port}") as channel:
        yield GenerationStub(channel)


def settled(server: RunningServer) -> None:
    """Every admission slot back, the engine idle, every KV block back in the pool."""
    deadline = time.monotonic() + 30
    while server.sequences_admitted and time.monotonic() < deadline:
        time.sleep(0.02)
    assert server.sequences_admitted == 0, "admission slots leaked"
    stats = server.wait_idle()
    assert stats.running == 0 and stats.waiting == 0
    assert stats.free_blocks == stats.total_blocks, "KV blocks leaked"


def code_of(call, *args, **kwargs) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as info:
        result = call(*args, **kwargs)
        if not isinstance(result, pb.GenerateResponse) and hasattr(result, "__iter__"):
            list(result)
    return info.value.code(), info.value.details()


def test_committed_stubs_are_what_the_proto_generates(tmp_path: Path) -> None:
    subprocess.run(["bash", "scripts/grpc_stubs.sh", str(tmp_path)], cwd=ROOT, check=True,
                   env={**os.environ, "PYTHON": sys.executable})
    names = ["ruvllm_pb2.py", "ruvllm_pb2.pyi", "ruvllm_pb2_grpc.py"]
    match, mismatch, errors = filecmp.cmpfiles(tmp_path / "ruvllm/grpc", ROOT / "src/ruvllm/grpc", names, shallow=False)
    assert match == names, f"regenerate with scripts/grpc_stubs.sh: {mismatch or errors} differ"


def test_generate_equals_completions_and_is_measured(server: RunningServer, stub: GenerationStub) -> None:
    out = stub.Generate(pb.GenerateRequest(text=PROMPT, sampling=GREEDY))
    body = httpx.post(f"{server.url}/v1/completions", timeout=60,
                      json={"model": MODEL, "prompt": PROMPT, "max_tokens": 12, "temperature": 0}).json()
    assert out.text == body["choices"][0]["text"] and out.text.strip()
    assert out.finish_reason == pb.FINISH_REASON_LENGTH and body["choices"][0]["finish_reason"] == "length"
    assert len(out.token_ids) == out.usage.completion_tokens == body["usage"]["completion_tokens"] == 12
    assert out.usage.prompt_tokens == body["usage"]["prompt_tokens"]
    assert out.usage.total_tokens == out.usage.prompt_tokens + 12
    assert out.model == MODEL and out.id.startswith("gen-")
    assert server.engine.tokenizer.decode(list(out.token_ids)) == out.text
    metrics = httpx.get(f"{server.url}/metrics").text
    assert re.search(r'^ruvllm:generation_tokens_total\{[^}]*endpoint="/ruvllm.v1.Generation/Generate"[^}]*\} 12.0$',
                     metrics, re.M), "gRPC calls are labelled by their method"
    settled(server)


def test_stream_joins_to_the_unary_text(server: RunningServer, stub: GenerationStub) -> None:
    req = pb.GenerateRequest(text=PROMPT, sampling=GREEDY)
    whole = stub.Generate(req)
    chunks = list(stub.GenerateStream(req))
    *pieces, last = chunks
    assert len(pieces) >= 2 and all(c.finish_reason == pb.FINISH_REASON_UNSPECIFIED for c in pieces)
    assert "".join(c.text for c in pieces) == whole.text
    assert [t for c in pieces for t in c.token_ids] == list(whole.token_ids)
    assert (last.text, last.token_ids, last.finish_reason) == ("", [], pb.FINISH_REASON_LENGTH)
    assert last.usage.completion_tokens == 12 and last.usage.prompt_tokens == whole.usage.prompt_tokens
    assert last.usage.total_tokens == last.usage.prompt_tokens + 12
    assert {c.id for c in chunks} == {chunks[0].id} != {whole.id}
    settled(server)


def test_a_stop_string_ends_both_alike(server: RunningServer, stub: GenerationStub) -> None:
    text = stub.Generate(pb.GenerateRequest(text=PROMPT, sampling=GREEDY)).text
    word = text.split()[1]  # the greedy text's second word: the completion stops just before it
    req = pb.GenerateRequest(text=PROMPT, sampling=pb.SamplingOptions(max_tokens=12, temperature=0, stop=[word]))
    whole = stub.Generate(req)
    *pieces, last = stub.GenerateStream(req)
    assert whole.text == text[:text.index(word)] == "".join(c.text for c in pieces)
    assert (whole.finish_reason, whole.stop_sequence) == (last.finish_reason, last.stop_sequence) == \
        (pb.FINISH_REASON_STOP, word)
    settled(server)


def test_chat_and_token_prompts(server: RunningServer, stub: GenerationStub) -> None:
    messages = [{"role": "user", "content": "Name a colour."}]
    chat = stub.Generate(pb.GenerateRequest(chat=pb.Chat(messages=[pb.ChatMessage(**m) for m in messages]),
                                            sampling=GREEDY))
    body = httpx.post(f"{server.url}/v1/chat/completions", timeout=60,
                      json={"model": MODEL, "messages": messages, "max_tokens": 12, "temperature": 0}).json()
    assert chat.text == body["choices"][0]["message"]["content"]
    assert chat.usage.prompt_tokens == body["usage"]["prompt_tokens"]
    ids = server.engine.tokenizer.encode(PROMPT)
    by_ids = stub.Generate(pb.GenerateRequest(tokens=pb.TokenIds(ids=ids), sampling=GREEDY))
    assert by_ids.text == stub.Generate(pb.GenerateRequest(text=PROMPT, sampling=GREEDY)).text
    settled(server)


def test_a_constraint_reaches_the_sampling_params() -> None:
    """The translation only: the constrained decoding behind it is SamplingParams.structured's, the path
    /v1/completions takes (tests/server/test_structured_server.py); its grammar compiler's start, seconds
    on this machine, is not paid twice. A malformed constraint is refused here, before any compile
    (test_bad_input_gets_its_status)."""
    req = pb.GenerateRequest(text=PROMPT, choice=pb.Choices(values=["yes", "no"]))
    assert sampling_params(req, 8).structured == StructuredOutputs(choice=["yes", "no"])
    req = pb.GenerateRequest(text=PROMPT, json_schema='{"type": "object"}')
    assert json.loads(sampling_params(req, 8).structured.json_schema) == {"type": "object"}
    assert sampling_params(pb.GenerateRequest(text=PROMPT, json_object=True), 8).structured.json_object
    assert sampling_params(pb.GenerateRequest(text=PROMPT), 8).structured is None


def test_the_user_names_the_tenant_and_its_prefix_cache(server: RunningServer, stub: GenerationStub) -> None:
    prompt = "Tenants keep their own prefix cache: " + " ".join(f"word{i}" for i in range(40))

    def cached(user: str) -> int:
        return stub.Generate(pb.GenerateRequest(text=prompt, user=user, sampling=pb.SamplingOptions(
            max_tokens=1, temperature=0))).usage.cached_tokens

    assert cached("alice") == 0
    assert cached("alice") >= 16  # at least a block of her own prompt
    assert cached("bob") == 0  # salted apart: nothing of alice's is his
    settled(server)


def test_models_and_health(server: RunningServer, stub: GenerationStub) -> None:
    models = stub.ListModels(pb.ListModelsRequest()).models
    assert [(m.id, m.parent, m.max_model_len) for m in models] == [(MODEL, "", server.engine.info.max_seq_len)]
    assert stub.Health(pb.HealthRequest()).status == pb.HealthResponse.SERVING


def test_cancelling_a_stream_frees_its_sequence(server: RunningServer, stub: GenerationStub) -> None:
    stream = stub.GenerateStream(pb.GenerateRequest(text=PROMPT, sampling=pb.SamplingOptions(
        max_tokens=400, temperature=0, ignore_eos=True)))
    next(stream), next(stream)
    assert server.sequences_admitted == 1 and server.engine.stats().free_blocks < server.engine.stats().total_blocks
    stream.cancel()
    assert code_of(lambda: list(stream))[0] == grpc.StatusCode.CANCELLED
    settled(server)


def test_a_deadline_aborts_a_unary_call(server: RunningServer, stub: GenerationStub) -> None:
    req = pb.GenerateRequest(text=PROMPT, sampling=pb.SamplingOptions(max_tokens=400, temperature=0, ignore_eos=True))
    assert code_of(stub.Generate, req, timeout=0.5)[0] == grpc.StatusCode.DEADLINE_EXCEEDED
    settled(server)


@pytest.mark.parametrize("req, code, says", [
    (pb.GenerateRequest(sampling=GREEDY), "INVALID_ARGUMENT", "one of text, tokens or chat"),
    (pb.GenerateRequest(text=PROMPT, sampling=pb.SamplingOptions(top_p=0)), "INVALID_ARGUMENT", "sampling.top_p"),
    (pb.GenerateRequest(text=PROMPT, sampling=pb.SamplingOptions(max_tokens=0)), "INVALID_ARGUMENT", "max_tokens"),
    (pb.GenerateRequest(text=PROMPT, sampling=pb.SamplingOptions(temperature=float("nan"))), "INVALID_ARGUMENT",
     "temperature"),
    (pb.GenerateRequest(text=PROMPT, sampling=pb.SamplingOptions(stop=["x"] * 17)), "INVALID_ARGUMENT", "stop"),
    (pb.GenerateRequest(text=""), "INVALID_ARGUMENT", "prompt is empty"),
    (pb.GenerateRequest(tokens=pb.TokenIds(ids=[1, 10**9])), "INVALID_ARGUMENT", "out of range"),
    (pb.GenerateRequest(tokens=pb.TokenIds(ids=[1] * 20000)), "INVALID_ARGUMENT", "maximum context length"),
    (pb.GenerateRequest(text=PROMPT, sampling=pb.SamplingOptions(max_tokens=10**6)), "INVALID_ARGUMENT",
     "maximum context length"),
    (pb.GenerateRequest(chat=pb.Chat()), "INVALID_ARGUMENT", "at least one message"),
    (pb.GenerateRequest(chat=pb.Chat(messages=[pb.ChatMessage(role="robot", content="hi")])), "INVALID_ARGUMENT",
     "role"),
    (pb.GenerateRequest(text=PROMPT, regex="(unclosed"), "INVALID_ARGUMENT", "regex"),
    (pb.GenerateRequest(text=PROMPT, json_schema="{not json"), "INVALID_ARGUMENT", "json_schema"),
    (pb.GenerateRequest(text=PROMPT, priority=99), "INVALID_ARGUMENT", "priority"),
    (pb.GenerateRequest(text=PROMPT, user="u" * 257), "INVALID_ARGUMENT", "user"),
    (pb.GenerateRequest(text=PROMPT, model="no-such-model"), "NOT_FOUND", "no-such-model"),
], ids=lambda v: v if isinstance(v, str) else None)
@pytest.mark.parametrize("rpc", ["Generate", "GenerateStream"])
def test_bad_input_gets_its_status(server: RunningServer, stub: GenerationStub, rpc: str, req: pb.GenerateRequest,
                                   code: str, says: str) -> None:
    got, details = code_of(getattr(stub, rpc), req)
    assert got == getattr(grpc.StatusCode, code) and says in details, (got, details)
    assert server.sequences_admitted == 0 and server.engine.is_alive


def test_bytes_that_are_no_message(server: RunningServer) -> None:
    with grpc.insecure_channel(f"127.0.0.1:{server.app.state.grpc_port}") as channel:
        raw = channel.unary_unary("/ruvllm.v1.Generation/Generate")
        for data in (b"\x0a\x02\xff\xfe", b"\xff\xff\xff"):  # text that is not UTF-8; no wire format at all
            got, details = code_of(raw, data)
            assert got == grpc.StatusCode.INVALID_ARGUMENT and "not a GenerateRequest" in details


# Keys, tenants and capacity: a server of its own, one sequence at a time and no queue, 64 KiB messages.
KEYS = (("alice-key", "alice"),)


@pytest.fixture(scope="module")
def keyed(_shared_llm: LLM) -> Iterator[tuple[RunningServer, GenerationStub]]:
    for running in start_server(_shared_llm, max_num_seqs=1, max_queue=0, grpc_port=free_port(), api_key="shared",
                                api_keys=KEYS, max_request_bytes=1 << 16):
        with grpc.insecure_channel(f"127.0.0.1:{running.app.state.grpc_port}") as channel:
            yield running, GenerationStub(channel)


def test_keys_are_required_and_name_the_tenant(keyed: tuple[RunningServer, GenerationStub]) -> None:
    server, stub = keyed
    prompt = list(range(1, 41))  # more than two blocks of tokens

    def call(metadata: tuple[tuple[str, str], ...], user: str = "") -> pb.GenerateResponse:
        return stub.Generate(pb.GenerateRequest(tokens=pb.TokenIds(ids=prompt), user=user, sampling=pb.SamplingOptions(
            max_tokens=1, temperature=0)), metadata=metadata)

    for metadata in ((), (("authorization", "Bearer wrong"),), (("authorization", "alice-key"),)):
        assert code_of(call, metadata)[0] == grpc.StatusCode.UNAUTHENTICATED
        assert code_of(stub.ListModels, pb.ListModelsRequest(), metadata=metadata)[0] == grpc.StatusCode.UNAUTHENTICATED
    assert stub.Health(pb.HealthRequest()).status == pb.HealthResponse.SERVING  # a probe needs no key
    alice = (("authorization", "Bearer alice-key"),)
    assert call(alice).usage.cached_tokens == 0
    assert call((("x-api-key", "alice-key"),)).usage.cached_tokens >= 16  # the same tenant: her cache
    # The shared key with tenants' keys is the default tenant's: `user` never names a key's tenant
    assert call((("authorization", "bearer shared"),), user="alice").usage.cached_tokens == 0
    assert [m.id for m in stub.ListModels(pb.ListModelsRequest(), metadata=alice).models] == [MODEL]
    settled(server)


def test_capacity_is_resource_exhausted(keyed: tuple[RunningServer, GenerationStub]) -> None:
    server, stub = keyed
    alice = (("authorization", "Bearer alice-key"),)
    stream = stub.GenerateStream(pb.GenerateRequest(tokens=pb.TokenIds(ids=[1, 2, 3]), sampling=pb.SamplingOptions(
        max_tokens=200, ignore_eos=True)), metadata=alice)
    next(stream)
    with pytest.raises(grpc.RpcError) as info:
        stub.Generate(pb.GenerateRequest(tokens=pb.TokenIds(ids=[1, 2, 3])), metadata=alice)
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "capacity" in info.value.details()
    assert ("retry-after", "1") in info.value.trailing_metadata()
    stream.cancel()
    settled(server)
    got, details = code_of(stub.Generate, pb.GenerateRequest(text="x" * (1 << 16)), metadata=alice)
    assert got == grpc.StatusCode.RESOURCE_EXHAUSTED, details  # over --max-request-bytes


# `ruvllm serve --grpc-port`: a port in use fails at once, before the model loads (the server itself is the
# one started above: the app's lifespan starts gRPC, under `serve` as under the test's uvicorn)
SERVE = [sys.executable, "-m", "ruvllm.cli.main", "serve"]


def test_grpc_port_in_use_is_one_line() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        r = subprocess.run([*SERVE, "--port", str(free_port()), "--grpc-port", str(s.getsockname()[1])],
                           capture_output=True, text=True, timeout=180)
    assert r.returncode != 0 and "Traceback" not in r.stderr and "in use" in r.stderr


def test_ray_serve_refuses_a_grpc_port() -> None:
    with pytest.raises(ValueError, match="grpc_port"):
        RayServeConfig(server=ServerConfig(grpc_port=50051))
