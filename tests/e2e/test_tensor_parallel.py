"""Tensor parallelism end to end (docs/scaling.md, "Tensor parallelism"): ranks on gloo compute the
logits of one process within 1e-4 in fp32, for a prompt (at once and in chunks) and for decode steps,
and generate the same greedy text; with KV heads split (4 heads, 2 KV heads) and replicated (1 KV
head on 2 ranks, with q/k/v biases, a tied LM head and a vocabulary the ranks do not divide), and on
the default model (9 heads: 3 ranks). A core process with TP = 2 (what `ruvllm serve` and each
data-parallel replica run) starts its rank and stops it on shutdown and when killed; a rank that
dies fails the next step naming it. What tensor parallelism cannot run is refused in one line."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import random
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
import torch

from ruvllm import LLM, AsyncEngine, EngineConfig, SamplingParams
from ruvllm.config import CacheConfig
from ruvllm.core.kv_cache_manager import KVCacheManager
from ruvllm.errors import ModelLoadError
from ruvllm.models.random_weights import random_weights
from ruvllm.worker.worker import Worker
from tests.engine_fixtures import TINY_GQA, write_tiny_model
from tests.reference import teacher_forced_logits

ATOL = 1e-4
TINY_MQA = dataclasses.replace(TINY_GQA, architecture="qwen2", num_kv_heads=1, vocab_size=509,
                               tie_word_embeddings=True, attention_bias=True)
MODELS = {"gqa": TINY_GQA, "mqa-qwen2-tied-odd-vocab": TINY_MQA}
ENGINE = dict(dtype="float32", num_blocks=128, max_num_batched_tokens=64, max_num_seqs=16)


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tensor-parallel")
    return {name: write_tiny_model(root / name, cfg, max_positions=512) for name, cfg in MODELS.items()}


@pytest.fixture(scope="module", params=list(MODELS))
def pair(request: pytest.FixtureRequest, folders: dict[str, Path]) -> Iterator[tuple[LLM, LLM]]:
    """The same tiny model in one process and on 2 ranks."""
    folder = str(folders[request.param])
    two = LLM(folder, tensor_parallel_size=2, **ENGINE)
    yield LLM(folder, **ENGINE), two
    two.close()


def _logits(llm: LLM, prompt: list[int], continuation: list[int], chunk: int | None = None) -> torch.Tensor:
    """Teacher-forced logits straight through the engine's runner (on 2 ranks: rank 0's, which
    drives the other): after the prompt, then after each continuation token."""
    runner = llm.core.executor.runner
    kv = KVCacheManager(runner.num_blocks, runner.block_size, enable_prefix_caching=False)
    out = teacher_forced_logits(kv, runner, prompt, continuation, chunk)
    llm.reset_prefix_cache()  # the pool's blocks were written behind the engine's back
    return out


def test_tp2_logits_equal_tp1_for_a_prompt_and_decode_steps(pair: tuple[LLM, LLM]) -> None:
    one, two = pair
    rng = random.Random(0)
    vocab = one.info.vocab_size
    prompt = [rng.randrange(1, vocab) for _ in range(70)]
    continuation = [rng.randrange(1, vocab) for _ in range(24)]
    expected = _logits(one, prompt, continuation)
    for chunk in (None, 16):  # the prompt at once, and in chunks of 16 (each chunk reads the cache)
        got = _logits(two, prompt, continuation, chunk)
        assert got.shape == expected.shape == (1 + len(continuation), vocab)
        diff = (got - expected).abs().max().item()
        assert diff < ATOL, f"max |logit diff| {diff:.2e} (chunk {chunk})"
        assert torch.equal(got.argmax(-1), expected.argmax(-1))


def test_tp2_greedy_text_equals_tp1_in_one_batch(pair: tuple[LLM, LLM]) -> None:
    one, two = pair
    rng = random.Random(1)
    prompts = [[rng.randrange(2, 500) for _ in range(5 + 7 * i)] for i in range(6)]  # token ids
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=1)
    a, b = one.generate(prompts, params), two.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in a] == [o.outputs[0].token_ids for o in b]
    assert [o.outputs[0].text for o in a] == [o.outputs[0].text for o in b]
    for x, y in zip(a, b):
        lx = [next(iter(d.values())).logprob for d in x.outputs[0].logprobs]
        ly = [next(iter(d.values())).logprob for d in y.outputs[0].logprobs]
        assert max(abs(p - q) for p, q in zip(lx, ly)) < ATOL
    stats = two.stats()
    assert stats.idle and stats.free_blocks == stats.total_blocks


def test_zz_a_rank_that_dies_fails_the_next_step_naming_it(pair: tuple[LLM, LLM]) -> None:
    """Last for each model (it kills the pair's rank): the step fails at once, it does not hang."""
    _, two = pair
    rank = two.core.executor.tensor_parallel._procs.procs[0]
    rank.kill()
    rank.wait(5)
    started = time.monotonic()
    with pytest.raises(RuntimeError, match=r"tensor-parallel rank 1 exited \(exit code -9\)"):
        two.generate([[5, 6]], SamplingParams(max_tokens=4))
    assert time.monotonic() - started < 10


def test_the_default_model_on_3_ranks_gives_its_logits_and_greedy_text(llm: LLM) -> None:
    """SmolLM2-135M (9 heads, 3 KV heads: one KV head per rank), every weight dense in fp32; then a
    call that fails halfway on rank 0."""
    one = llm.with_settings(cache=CacheConfig(num_blocks=64))
    three = LLM(dtype="float32", quantization="none", num_blocks=64, tensor_parallel_size=3)
    try:
        prompt = one.tokenizer.encode("The capital of France is Paris, and the capital of Italy is")
        continuation = one.tokenizer.encode(" Rome. Both are old cities with", add_special_tokens=False)
        diff = (_logits(three, prompt, continuation) - _logits(one, prompt, continuation)).abs().max().item()
        assert diff < ATOL, f"max |logit diff| {diff:.2e}"
        params = SamplingParams(temperature=0, max_tokens=16)
        texts = [o.outputs[0].text for o in one.generate(["The capital of France is", "Once upon a time"], params)]
        assert texts == [o.outputs[0].text for o in three.generate(["The capital of France is", "Once upon a time"],
                                                                     params)]
        # A call that fails halfway (rank 0 raises inside a layer, the other ranks wait in its
        # all-reduce): the error comes through, later calls are refused, and the ranks still stop.
        ranks = [psutil.Process(p.pid) for p in three.core.executor.tensor_parallel._procs.procs]

        def fail(x: torch.Tensor) -> torch.Tensor:
            raise RuntimeError("injected failure")

        three.model.layers[15].down_proj.forward = fail
        with pytest.raises(RuntimeError, match="injected failure"):
            three.generate(["Once upon a time"], params)
        with pytest.raises(RuntimeError, match="out of step since a call failed"):
            three.generate(["Once upon a time"], params)
        started = time.monotonic()
        three.close()
        assert time.monotonic() - started < 8 and _all_gone(ranks, 1)
    finally:
        three.close()


# --- the core process (ruvllm serve, each data-parallel replica) -----------------------------------
def _rank_processes(engine: AsyncEngine) -> list[psutil.Process]:
    ranks = psutil.Process(engine._client.process.pid).children()
    assert len(ranks) == 1 and "ruvllm.parallel.rank_process" in ranks[0].cmdline()
    return ranks


def _all_gone(procs: list[psutil.Process], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if all(not p.is_running() or p.status() == psutil.STATUS_ZOMBIE for p in procs):
            return True
        time.sleep(0.05)
    return False


async def _greedy(engine: AsyncEngine, prompts: list[str]) -> list[str]:
    async def one(p: str) -> str:
        text = ""
        async for out in engine.generate(p, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)):
            text = out.outputs[0].text
        return text

    return list(await asyncio.gather(*(one(p) for p in prompts)))


def test_a_core_process_with_tp2_serves_what_one_process_does_and_stops_its_rank(folders: dict[str, Path]) -> None:
    folder = str(folders["gqa"])
    engine = AsyncEngine.launch(EngineConfig(model=folder, tensor_parallel_size=2, dtype="float32",
                                      cache=CacheConfig(num_blocks=128)))
    try:
        ranks = _rank_processes(engine)
        prompts = [f"t{i} t{2 * i} t{3 * i + 1}" for i in range(2, 10)]
        texts = asyncio.run(_greedy(engine, prompts))
    finally:
        engine.shutdown()
    expected = LLM(folder, **ENGINE).generate(prompts, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    assert texts == [o.outputs[0].text for o in expected]
    assert _all_gone(ranks, 5), "a tensor-parallel rank outlived the engine's shutdown"


def test_a_killed_core_process_takes_its_rank_with_it(folders: dict[str, Path]) -> None:
    engine = AsyncEngine.launch(EngineConfig(model=str(folders["gqa"]), tensor_parallel_size=2, dtype="float32",
                                      cache=CacheConfig(num_blocks=128)))
    try:
        ranks = _rank_processes(engine)
        # The ranks' rendezvous sits in the front's folder (the core's TMPDIR), which the front removes:
        # neither the killed core nor its ranks (killed with it) could.
        front_folder = Path(engine._client._tmp.name)
        assert [p.name[:10] for p in front_folder.iterdir() if p.is_dir()] == ["ruvllm-tp-"]
        os.kill(engine._client.process.pid, signal.SIGKILL)
        assert _all_gone(ranks, 5), "a tensor-parallel rank outlived its killed core process"
    finally:
        engine.shutdown()
    assert not front_folder.exists()


# --- refused, in one line ------------------------------------------------------------------------
def test_what_tensor_parallelism_cannot_run_is_refused_in_one_line(folders: dict[str, Path]) -> None:
    folder = str(folders["gqa"])
    before = {p.pid for p in psutil.Process().children()}
    cases = [
        (dict(model=None, tensor_parallel_size=2, quantization="none"),
         "9 attention heads do not split evenly across 2 ranks.*sizes that fit this model: 1, 3"),
        (dict(model=None, tensor_parallel_size=3),
         "packed weights .*int4 g32.*quantization auto; pass quantization none"),
        (dict(model=folder, tensor_parallel_size=3), "4 attention heads do not split evenly across 3 ranks"),
        (dict(model=folder, tensor_parallel_size=2, enable_lora=True, speculative="ngram", kv_cache_dtype="int8"),
         r"LoRA adapters \(enable_lora\); speculative decoding \(ngram\); an int8 KV cache"),
        (dict(model=folder, tensor_parallel_size=2, quantization="int8"), "packed weights"),
    ]
    for kwargs, expected in cases:
        with pytest.raises(ValueError, match=expected) as err:
            LLM(kwargs.pop("model"), **kwargs)
        assert "\n" not in str(err.value)
    assert {p.pid for p in psutil.Process().children()} <= before, "a refused engine left a rank process"


def test_a_gemma3_model_and_weights_that_cannot_travel_are_refused(folders: dict[str, Path]) -> None:
    from ruvllm.engine.llm import build_engine_config

    before = {p.pid for p in psutil.Process().children()}
    gemma = dataclasses.replace(TINY_GQA, architecture="gemma3", sliding_layers=(0,), sliding_window=8)
    config = build_engine_config(tensor_parallel_size=2, dtype="float32")
    with pytest.raises(ValueError, match="cannot run a gemma3 model"):
        Worker.from_weights(gemma, lambda dt: random_weights(gemma, dt, "cpu"), config)
    with pytest.raises(ValueError, match="weights from code need a function that pickles"):
        Worker.from_weights(TINY_GQA, lambda dt: random_weights(TINY_GQA, dt, "cpu"), config)
    assert {p.pid for p in psutil.Process().children()} <= before, "a refused engine left a rank process"


def test_a_rank_that_fails_to_load_fails_the_load_with_its_error() -> None:
    from ruvllm.engine.llm import build_engine_config
    from tests.rank_fixtures import LoadsInOwnerOnly

    before = {p.pid for p in psutil.Process().children()}
    config = build_engine_config(tensor_parallel_size=2, dtype="float32", num_blocks=16)
    with pytest.raises(ModelLoadError, match=r"rank 1: OSError: the disk went away \(injected\)"):
        Worker.from_weights(TINY_GQA, LoadsInOwnerOnly(TINY_GQA, os.getpid()), config)
    assert {p.pid for p in psutil.Process().children() if p.status() != psutil.STATUS_ZOMBIE} <= before
