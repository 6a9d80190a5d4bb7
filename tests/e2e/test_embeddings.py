"""The engine's pooling path: vectors equal transformers' final hidden state (after the final norm)
pooled and normalized; each input gets the same vector, bit for bit, alone, in a batch, beside
running generation, cut into chunks, and through the prefix cache; no KV block outlives a request
(every fixture checks that); and the same vector through the core process."""

from __future__ import annotations

import asyncio

import pytest
import torch

from ruvllm import LLM, AsyncEngine, SamplingParams, SchedulerConfig
from ruvllm.config import CacheConfig, EngineConfig
from ruvllm.loader import resolve_model
from ruvllm.outputs import OutputKind
from ruvllm.request import Priority
from tests.engine_fixtures import more_ids, prompt_ids
from tests.reference import hf_reference

POOLINGS = ["last", "mean"]


@pytest.fixture
def tiny(_tiny_llm: LLM):
    """The tiny model, checked as every engine fixture is (idle, every block back): the scheduling
    paths below do not depend on the kernels' precision, which the batch test covers at both."""
    from tests.conftest import _checked

    yield from _checked(_tiny_llm)


def _vectors(llm: LLM, prompts: list, pooling: str) -> list[list[float]]:
    return [o.embedding for o in llm.embed(prompts, pooling=pooling)]


def _alone(llm: LLM, prompts: list, pooling: str) -> list[list[float]]:
    return [llm.embed(p, pooling=pooling)[0].embedding for p in prompts]


def test_vectors_equal_transformers_pooled_last_hidden_state(llm: LLM) -> None:
    ref = hf_reference(resolve_model(None))
    prompts = prompt_ids(llm, 2, words=20)  # 22 and 29 tokens: each crosses a 16-position group of mean pooling
    # One transformers forward per prompt serves both poolings (it was one per pooling: 4 forwards, ~2 s).
    with torch.no_grad():
        hidden = [ref.model(torch.tensor([ids])).last_hidden_state[0].float() for ids in prompts]  # after the norm
    for pooling in POOLINGS:
        ours = torch.tensor(_vectors(llm, prompts, pooling))
        for states, vector in zip(hidden, ours):
            pooled = states[-1] if pooling == "last" else states.mean(dim=0)
            expected = pooled / pooled.norm()
            assert vector.shape == expected.shape
            diff = (vector - expected).abs().max().item()
            assert diff < 1e-4, f"{pooling}: max |diff| {diff:.2e}"
    assert llm.info.pooling == "last"  # the engine's default (EngineConfig.pooling)
    assert _vectors(llm, prompts[:1], "last") == _vectors(llm, prompts[:1], None)  # type: ignore[arg-type]


def test_a_batch_and_chunks_give_each_input_its_vector_alone(precision_llm: LLM) -> None:
    # 5, 21 and 37 tokens (63 in all: the default model's CPU steps cost by the token, and 4 inputs of
    # 7..64 tokens, 142 in all, took 9 s of this test's 12). A 24-token budget cuts the longer two
    # into chunks at places that depend on the others (the 21 after its 19th token, the 37 after its
    # 22nd), inside mean pooling's 16-position groups; no kernel is chosen by batch size (decisions.md).
    prompts = [p[: 5 + 16 * i] for i, p in enumerate(prompt_ids(precision_llm, 3, words=40))]
    chunked = precision_llm.with_settings(scheduler=SchedulerConfig(max_num_batched_tokens=24, max_num_seqs=8))
    for pooling in POOLINGS:
        alone = _alone(precision_llm, prompts, pooling)
        assert _vectors(precision_llm, prompts, pooling) == alone, pooling
        assert _vectors(chunked, prompts, pooling) == alone, pooling
    stats = chunked.stats()
    assert stats.idle and stats.free_blocks == stats.total_blocks, "KV blocks kept after embedding"


def test_embeddings_beside_running_generation(tiny: LLM) -> None:
    """In the same steps as decodes and prompt chunks (through AsyncEngine, on a thread), under one budget."""
    prompts = prompt_ids(tiny, 3, words=30)
    alone = {p: _alone(tiny, prompts, p) for p in POOLINGS}
    greedy = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)  # decoding all through the embeddings
    engine = tiny.async_engine()

    async def run() -> tuple[dict, list]:
        async def generate(i: int) -> list[int]:
            async for out in engine.generate(prompts[i], greedy, f"g{i}", output_kind=OutputKind.FINAL_ONLY):
                last = out
            return last.outputs[0].token_ids

        gens = [asyncio.create_task(generate(i)) for i in range(len(prompts))]
        vectors = {p: await asyncio.gather(*(engine.embed(x, f"e-{p}{i}", pooling=p) for i, x in enumerate(prompts)))
                   for p in POOLINGS}
        assert not any(g.done() for g in gens)
        return vectors, await asyncio.gather(*gens)

    try:
        vectors, _ = asyncio.run(run())
    finally:
        engine.shutdown()
    assert {p: [v.embedding for v in vs] for p, vs in vectors.items()} == alone


def test_prefix_cache_hit_equals_miss_and_embedding_blocks_are_shared(tiny: LLM) -> None:
    """Last-token pooling takes prefix hits (only the last row is read); an embedding's full blocks
    are valid K/V, cached for later requests, generation included."""
    shared = prompt_ids(tiny, 1, words=60)[0]
    longer = shared + more_ids(tiny, " And so it went")
    tiny.embed(shared)
    hit = tiny.embed(longer, pooling="last")[0]
    assert hit.num_cached_tokens > 0 and hit.num_cached_tokens % 16 == 0
    out = tiny.generate([shared + more_ids(tiny, " Then")], SamplingParams(max_tokens=2))[0]
    assert out.num_cached_tokens == hit.num_cached_tokens
    tiny.reset_prefix_cache()
    miss = tiny.embed(longer, pooling="last")[0]
    assert miss.num_cached_tokens == 0 and miss.embedding == hit.embedding
    # Mean pooling reads every row: it takes no hit.
    assert tiny.embed(longer, pooling="mean")[0].num_cached_tokens == 0


def test_bad_inputs_are_refused_before_the_core(llm: LLM) -> None:
    from ruvllm.errors import RequestError

    for bad in ([llm.info.vocab_size], [-1], [1] * (llm.info.max_seq_len + 1)):
        with pytest.raises(RequestError):
            llm.embed(bad)
    with pytest.raises(RequestError):
        llm.embed([1, 2], pooling="max")
    with pytest.raises(TypeError):
        llm.embed([])


def test_through_the_core_process(tiny_model_dir, _tiny_llm: LLM) -> None:
    """msgspec across the process boundary: the same vectors as the engine in this process. (Its
    time, ~3 s of CPU and 9-11 s of wall under load, is the core process's start and exit; the
    embedding of these inputs takes milliseconds.)"""
    prompts = prompt_ids(_tiny_llm, 3, words=40)
    expected = {p: _vectors(_tiny_llm, prompts, p) for p in POOLINGS}
    engine = AsyncEngine.launch(EngineConfig(model=str(tiny_model_dir), dtype="float32",
                                             cache=CacheConfig(num_blocks=128),
                                             scheduler=SchedulerConfig(max_num_batched_tokens=256, max_num_seqs=32)))

    async def run() -> dict[str, list[list[float]]]:
        return {p: [o.embedding for o in await asyncio.gather(*(engine.embed(x, pooling=p) for x in prompts))]
                for p in POOLINGS}

    try:
        got = asyncio.run(run())
        stats = engine.stats()
    finally:
        engine.shutdown()
    assert got == expected
    assert stats.idle and stats.free_blocks == stats.total_blocks


def test_preempted_embeddings_equal_uninterrupted(tiny: LLM) -> None:
    """A small pool: high-priority generations growing through long, chunked embeddings preempt them
    (their blocks freed, their pooling started again); each vector is still the one it gets alone."""
    prompts = prompt_ids(tiny, 4, words=150)  # ~195 tokens: 7 chunks of the 32-token budget, 13 blocks
    alone = {p: _alone(tiny, prompts, p) for p in POOLINGS}
    small = tiny.with_settings(cache=CacheConfig(num_blocks=20),
                               scheduler=SchedulerConfig(max_num_batched_tokens=32, max_num_seqs=8))
    engine = small.async_engine()
    greedy = SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)

    async def run() -> dict:
        async def generate(i: int) -> None:
            async for _ in engine.generate(prompts[i][:20], greedy, f"g{i}", priority=Priority.HIGH):
                pass

        gens = [asyncio.create_task(generate(i)) for i in range(2)]
        vectors = {p: await asyncio.gather(*(engine.embed(x, f"e-{p}{i}", pooling=p) for i, x in enumerate(prompts)))
                   for p in POOLINGS}
        await asyncio.gather(*gens)
        return vectors

    try:
        vectors = asyncio.run(run())
        stats = engine.stats()
    finally:
        engine.shutdown()
    assert stats.preemptions > 0
    assert stats.idle and stats.free_blocks == stats.total_blocks
    assert {p: [v.embedding for v in vs] for p, vs in vectors.items()} == alone
