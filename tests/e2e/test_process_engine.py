"""The engine core in its own process (what `ruvllm serve` runs) against the same engine in this
process: identical outputs, the invariants hold through the process boundary, a dead core fails
every open request at once, and shutdown leaves no child behind."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Iterator

import pytest

from ruvllm import LLM, AsyncEngine, EngineConfig, SamplingParams
from ruvllm.config import CacheConfig, QuantConfig, SchedulerConfig
from ruvllm.errors import EngineDeadError, NotAModelError
from ruvllm.outputs import OutputKind, RequestOutput

from tests.conftest import novel_prompts

# Small on purpose: 16 requests of 35-48-token prompts (3 blocks each) grow by up to 8 new tokens,
# which takes 10 of them past 48 tokens (a 4th block). 18 blocks hold 6 prompts, and a running one
# that needs a block when none is free preempts another (however the requests' arrivals interleave
# with the first steps); a 48-token budget shared with decodes chunks prompts: every invariant is
# exercised at once. (3 preemptions, counted on a thread core with these settings, as the former
# 28 blocks with 16 new tokens had. Prompts near a block's end let 8 new tokens cross it: the 16
# requests alone in this process, one at a time, were half this file's CPU time at 16 tokens.)
TIGHT = dict(cache=CacheConfig(num_blocks=18), scheduler=SchedulerConfig(max_num_batched_tokens=48, max_num_seqs=16))


@pytest.fixture(scope="module")
def process_engine() -> Iterator[AsyncEngine]:
    engine = AsyncEngine.launch(EngineConfig(dtype="float32", quantization=QuantConfig("none"), **TIGHT))  # as `llm`
    yield engine
    engine.shutdown()
    assert engine._client.process.poll() is not None, "the core process outlived shutdown"


def _params() -> list[SamplingParams]:
    """Greedy, seeded sampling with n > 1, stop strings, logprobs, penalties: what crosses the wire."""
    return [SamplingParams(temperature=0, max_tokens=8, logprobs=2),
            SamplingParams(temperature=0.9, top_p=0.9, seed=7, n=2, max_tokens=8),
            SamplingParams(temperature=0, max_tokens=8, stop=[".", ","], include_stop_str_in_output=True),
            SamplingParams(temperature=0.7, top_k=20, seed=3, max_tokens=8, repetition_penalty=1.3,
                           presence_penalty=0.5, min_tokens=4)]


async def _collect(engine: AsyncEngine, prompts: list[str], params: list[SamplingParams]) -> list[RequestOutput]:
    async def one(i: int) -> RequestOutput:
        last = None
        async for out in engine.generate(prompts[i], params[i], f"r{i}", output_kind=OutputKind.FINAL_ONLY):
            last = out
        assert last is not None and last.finished
        return last

    return list(await asyncio.gather(*(one(i) for i in range(len(prompts)))))


def _key(out: RequestOutput) -> list[tuple]:
    return [(c.text, c.token_ids, c.finish_reason, c.stop_reason,
             None if c.logprobs is None else [sorted((t, round(lp.logprob, 4)) for t, lp in e.items())
                                              for e in c.logprobs]) for c in out.outputs]


def test_sixteen_concurrent_through_the_process_equal_each_alone_in_process(process_engine: AsyncEngine,
                                                                          llm: LLM) -> None:
    """Isolation, 16 concurrent = alone, chunked = unchunked and preempted = uninterrupted, through
    the process boundary: the tight pool preempts and the small budget chunks every prompt."""
    prompts = novel_prompts(16, words=32)  # 35-48 tokens with the default model's tokenizer
    params = [_params()[i % 4] for i in range(16)]
    before = process_engine.stats()
    together = asyncio.run(_collect(process_engine, prompts, params))
    after = process_engine.stats()
    assert after.preemptions > before.preemptions, "the tight pool was meant to preempt"
    assert after.idle and after.free_blocks == after.total_blocks, "KV blocks leaked"
    alone = [llm.generate([p], sp)[0] for p, sp in zip(prompts, params)]
    for i, (a, b) in enumerate(zip(together, alone)):
        assert _key(a) == _key(b), f"request {i} differs between the core process (batched) and alone"


def test_prefix_hit_through_the_process_equals_miss(process_engine: AsyncEngine, llm: LLM) -> None:
    prompt = novel_prompts(1, words=60)[0]  # 68 tokens: 4 full blocks to hit
    params = SamplingParams(temperature=0, max_tokens=8)
    hits = process_engine.stats().prefix_hits
    first = asyncio.run(_collect(process_engine, [prompt], [params]))[0]
    second = asyncio.run(_collect(process_engine, [prompt], [params]))[0]
    assert process_engine.stats().prefix_hits > hits, "the second run was meant to hit the prefix cache"
    assert second.num_cached_tokens > 0
    assert _key(first) == _key(second) == _key(llm.generate([prompt], params)[0])


def test_a_stop_string_ends_the_request_and_frees_its_blocks(process_engine: AsyncEngine) -> None:
    """The front matches stop strings and aborts the sequence in the core: blocks come back."""
    out = asyncio.run(_collect(process_engine, ["Once upon a time"],
                               [SamplingParams(temperature=0, max_tokens=200, stop=[","])]))[0]
    assert out.outputs[0].finish_reason == "stop" and out.outputs[0].stop_reason == ","
    deadline = time.monotonic() + 10
    while not process_engine.stats().idle and time.monotonic() < deadline:
        time.sleep(0.05)
    stats = process_engine.stats()
    assert stats.idle and stats.free_blocks == stats.total_blocks


def test_a_grammar_compiles_in_the_core_process_and_equals_in_process(process_engine: AsyncEngine, llm: LLM) -> None:
    """Structured outputs cross the process boundary: the core compiles the grammar against the
    tokenizer it loads itself, and the output is the in-process engine's."""
    from ruvllm.structured.spec import StructuredOutputs

    params = SamplingParams(temperature=0, max_tokens=40, structured=StructuredOutputs(regex=r"[A-Z][a-z]+ [0-9]{2}"))
    out = asyncio.run(_collect(process_engine, ["The name and age:"], [params]))[0]
    assert _key(out) == _key(llm.generate(["The name and age:"], params)[0])
    assert out.outputs[0].finish_reason == "stop"


def test_delta_outputs_add_up_to_the_cumulative_ones(process_engine: AsyncEngine) -> None:
    params = SamplingParams(temperature=0.8, seed=11, n=2, max_tokens=10, logprobs=1)

    async def run(kind: OutputKind) -> list[RequestOutput]:
        return [o async for o in process_engine.generate("The weather today", params, output_kind=kind)]

    deltas = asyncio.run(run(OutputKind.DELTA))
    final = asyncio.run(run(OutputKind.CUMULATIVE))[-1]
    for c in final.outputs:
        parts = [d for o in deltas for d in o.outputs if d.index == c.index]
        assert "".join(d.text for d in parts) == c.text
        assert [t for d in parts for t in d.token_ids] == c.token_ids
        assert len([e for d in parts for e in d.logprobs or []]) == len(c.token_ids)
        assert [d.finish_reason for d in parts].count(c.finish_reason) == 1  # reported once, at the end


def test_a_load_error_in_the_core_process_is_the_same_error_here(tmp_path) -> None:
    bad = tmp_path / "model.gguf"
    bad.write_bytes(b"not a gguf file at all")
    with pytest.raises(NotAModelError, match="model.gguf"):
        AsyncEngine.launch(EngineConfig(model=str(bad)))


async def kill_mid_streams(engine: AsyncEngine, pid: int, n: int, max_tokens: int) -> list[float]:
    """`n` streams open, then the core's process `pid` killed: how long after the kill each stream that
    ended in EngineDeadError heard of it (seconds)."""
    started = asyncio.Event()
    failed_at: list[float] = []

    async def stream(i: int) -> None:
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        try:
            async for _ in engine.generate(f"Story {i}:", params):
                started.set()
        except EngineDeadError:
            failed_at.append(time.monotonic())

    tasks = [asyncio.create_task(stream(i)) for i in range(n)]
    await asyncio.wait_for(started.wait(), 60)
    await asyncio.sleep(0.5)
    os.kill(pid, signal.SIGKILL)
    killed = time.monotonic()
    await asyncio.wait_for(asyncio.gather(*tasks), 10)
    return [t - killed for t in failed_at]


def test_zz_a_killed_core_fails_every_open_stream_within_two_seconds(process_engine: AsyncEngine) -> None:
    """Last in this file (pytest runs a file's tests in order): it kills the module's engine rather
    than loading another one."""
    engine = process_engine
    child = engine._client.process  # the core's process: what a crash or the OOM killer would take
    try:
        delays = asyncio.run(kill_mid_streams(engine, child.pid, 16, max_tokens=400))
        assert len(delays) == 16, "every open stream must get EngineDeadError"
        assert max(delays) < 2.0, delays
        assert not engine.is_alive and engine.failure is not None
        assert "exit code -9" in str(engine.failure)
        with pytest.raises(EngineDeadError):  # later calls fail at once, never hang
            asyncio.run(_collect(engine, ["x"], [SamplingParams(max_tokens=2)]))
    finally:
        engine.shutdown()
    assert child.poll() is not None
