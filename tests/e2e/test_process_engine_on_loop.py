"""A core process's outputs read on the event loop (ProcessCoreClient.read_on, what `ruvllm serve`
does) rather than on the client's thread: the same outputs as before the hand-over, a blocking call
on that loop refused rather than waiting forever, a dead core failing every open stream within 2 s,
and a shutdown from another thread while streams are open leaving no child behind."""

from __future__ import annotations

import asyncio
import time

import pytest

from ruvllm import AsyncEngine, EngineConfig, SamplingParams
from ruvllm.errors import EngineDeadError, EngineShutdownError
from ruvllm.outputs import OutputKind
from tests.e2e.test_process_engine import kill_mid_streams

PROMPTS = ["the cat sat", "a dog ran home", "one two three", "the end"]


async def _texts(engine: AsyncEngine) -> list[tuple[str, str]]:
    """Each prompt's greedy text, as the last cumulative output and as its deltas added up."""

    async def one(i: int) -> tuple[str, str]:
        params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
        deltas = []
        async for out in engine.generate(PROMPTS[i], params, f"d{i}-{time.monotonic_ns()}",
                                         output_kind=OutputKind.DELTA):
            deltas.append(out.outputs[0].text)
        last = None
        async for out in engine.generate(PROMPTS[i], params, f"c{i}-{time.monotonic_ns()}"):
            last = out
        assert last is not None and last.finished
        return last.outputs[0].text, "".join(deltas)

    return list(await asyncio.gather(*(one(i) for i in range(len(PROMPTS)))))


def test_outputs_on_the_loop_equal_the_threads_and_a_killed_core_fails_every_stream(tiny_model_dir) -> None:
    engine = AsyncEngine.launch(EngineConfig(model=str(tiny_model_dir), num_threads=1))
    client = engine._client
    child = client.process
    try:
        async def main() -> list[float]:
            on_thread = await _texts(engine)  # the client's thread reads
            await engine.read_outputs_here()
            assert client._thread is not None and not client._thread.is_alive()
            assert await _texts(engine) == on_thread
            assert all(full and full == deltas for full, deltas in on_thread)
            with pytest.raises(RuntimeError, match="worker thread"):
                engine.stats()  # its answer would be read by this loop, which would be waiting
            assert (await asyncio.to_thread(engine.stats)).idle

            delays = await kill_mid_streams(engine, child.pid, 8, max_tokens=4000)
            with pytest.raises(EngineDeadError):  # later requests fail at once
                async for _ in engine.generate("x", SamplingParams(max_tokens=2)):
                    pass
            return delays

        delays = asyncio.run(main())
        assert len(delays) == 8 and max(delays) < 2.0, delays
        assert "exit code -9" in str(engine.failure)
    finally:
        engine.shutdown()
    assert child.poll() is not None


def test_shutdown_from_another_thread_while_streams_read_on_the_loop(tiny_model_dir) -> None:
    """As the many-model pool unloads a model (on a worker thread): open streams end with
    EngineShutdownError, the loop lets go of the socket before it is closed, the child is joined."""
    engine = AsyncEngine.launch(EngineConfig(model=str(tiny_model_dir), num_threads=1))
    child = engine._client.process

    async def main() -> list[BaseException]:
        await engine.read_outputs_here()
        started = asyncio.Event()

        async def stream(i: int) -> BaseException | None:
            try:
                async for _ in engine.generate(f"story {i}", SamplingParams(max_tokens=4000, ignore_eos=True)):
                    started.set()
            except (EngineShutdownError, EngineDeadError) as exc:
                return exc
            return None

        tasks = [asyncio.create_task(stream(i)) for i in range(4)]
        await asyncio.wait_for(started.wait(), 60)
        await asyncio.to_thread(engine.shutdown)
        assert engine._client._loop is None  # released on the loop's own thread before the sockets closed
        await asyncio.sleep(0.3)  # the loop goes on turning: no callback on a closed socket
        return await asyncio.wait_for(asyncio.gather(*tasks), 10)

    errors = asyncio.run(main())
    assert all(isinstance(e, EngineShutdownError) for e in errors), errors
    assert child.poll() is not None
