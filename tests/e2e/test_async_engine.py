"""The streaming engine: one engine thread, many concurrent asyncio callers, cancellation aborts."""

from __future__ import annotations

import asyncio

import pytest

from ruvllm import LLM, AsyncEngine, SamplingParams
from ruvllm.messages import EngineStats
from tests.conftest import novel_prompts
from tests.engine_fixtures import prompt_ids

GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


@pytest.fixture
def engine(llm: LLM):
    eng = llm.async_engine()
    yield eng
    eng.shutdown()


async def _idle(engine: AsyncEngine) -> EngineStats:
    """Engine stats once nothing runs or waits (aborts land at the next step), or after 5 s."""
    for _ in range(100):
        stats = engine.stats()
        if stats.idle:
            return stats
        await asyncio.sleep(0.05)
    return engine.stats()


def test_stream_matches_offline_and_grows(llm: LLM, engine: AsyncEngine) -> None:
    prompt = novel_prompts(1)[0]
    expected = llm.generate(prompt, GREEDY)[0].outputs[0]

    async def run():
        seen = []
        async for out in engine.generate(prompt, GREEDY):
            seen.append(out)
        return seen

    seen = asyncio.run(run())
    assert [len(o.outputs[0].token_ids) for o in seen] == list(range(1, 17))
    assert seen[-1].finished and not any(o.finished for o in seen[:-1])
    assert seen[-1].outputs[0].token_ids == expected.token_ids
    assert seen[-1].outputs[0].text == expected.text
    texts = [o.outputs[0].text for o in seen]
    assert all(b.startswith(a) for a, b in zip(texts, texts[1:]))  # text only grows


def test_concurrent_callers_are_batched_and_isolated(_tiny_llm: LLM) -> None:
    """On the tiny model (what is tested is the front's concurrency, not the model); compared on
    tokens and their logprobs, bit for bit."""
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=0)
    prompts = prompt_ids(_tiny_llm, 12)

    def seq(out):
        c = out.outputs[0]
        return c.token_ids, [lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs)]

    alone = [seq(_tiny_llm.generate(p, params)[0]) for p in prompts]
    engine = _tiny_llm.async_engine()
    max_running = 0

    async def one(p: list[int]):
        nonlocal max_running
        last = None
        async for out in engine.generate(p, params):
            last = out
            max_running = max(max_running, engine.snapshot.running)
        return seq(last)

    async def run():
        return await asyncio.gather(*(one(p) for p in prompts))

    try:
        assert asyncio.run(run()) == alone
    finally:
        engine.shutdown()
    assert max_running > 1  # requests really shared steps


def test_cancelling_a_stream_aborts_and_frees_blocks(llm: LLM, engine: AsyncEngine) -> None:
    params = SamplingParams(temperature=0, max_tokens=500, ignore_eos=True)

    async def run():
        async def consume():
            async for _ in engine.generate(novel_prompts(1, words=100)[0], params):
                pass
        task = asyncio.create_task(consume())
        await asyncio.sleep(1.0)
        assert engine.stats().free_blocks < engine.stats().total_blocks
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return await _idle(engine)

    stats = asyncio.run(run())
    assert stats.running == 0 and stats.free_blocks == stats.total_blocks


def test_breaking_out_early_aborts(engine: AsyncEngine) -> None:
    async def run():
        n = 0
        async for _ in engine.generate("Count to one hundred:", SamplingParams(max_tokens=300, ignore_eos=True)):
            n += 1
            if n == 3:
                break
        return await _idle(engine)

    stats = asyncio.run(run())
    assert stats.running == 0 and stats.free_blocks == stats.total_blocks


def test_bad_request_raises_to_the_caller_only(engine: AsyncEngine) -> None:
    async def run():
        with pytest.raises(ValueError, match="out of range"):
            async for _ in engine.generate([10**9], GREEDY):
                pass
        outs = [o async for o in engine.generate("Hi", GREEDY)]
        return outs[-1]

    assert asyncio.run(run()).finished


def test_write_from_a_thread_without_a_loop(llm: LLM, engine: AsyncEngine) -> None:
    """AsyncEngine.write, the learner's host's (the question forms' writer): blocking, from a thread
    with no event loop, as the server's learning threads call it: the base model's texts, as the
    offline LLM.write gives them (greedy: the same bits), each prompt's n of them."""
    import threading

    prompts = prompt_ids(llm, 2, words=6)
    params = SamplingParams(temperature=0, max_tokens=6, n=2)
    expected = llm.write(prompts, params)  # first: the LLM must not step its core while the engine's thread does
    got: list = []
    thread = threading.Thread(target=lambda: got.append(engine.write(prompts, params)))
    thread.start()
    thread.join(60)
    assert got and got[0] == expected
    assert [len(texts) for texts in expected] == [2, 2] and all(texts[0] for texts in expected)
