"""The core's stats are built once per change and never stale: after an add, a step, an abort or a
cache reset the next stats (EngineCore.stats, and what CoreLoop publishes) show it at once."""

from __future__ import annotations

import pytest

from ruvllm.engine.core_loop import CoreLoop
from ruvllm.messages import (AbortRequests, AddRequests, Call, CallResult, CoreMessage, CoreRequest, GetStats,
                             ResetPrefixCache, StepOutputs)
from ruvllm.sampling_params import SamplingParams
from tests.engine_fixtures import tiny_llm


@pytest.fixture(scope="module")
def core():  # noqa: ANN201
    return tiny_llm("cpu").core


def _request(rid: str) -> CoreRequest:
    return CoreRequest(rid, list(range(1, 40)), SamplingParams(max_tokens=8, temperature=0.0), eos_token_ids=(0,))


def test_stats_change_with_each_change_and_only_then(core) -> None:  # noqa: ANN001
    idle = core.stats()
    assert idle.idle and core.stats() is idle  # nothing changed: the same stats, not built again
    core.add_request(_request("a"))
    added = core.stats()
    assert (added.waiting, added.running) == (1, 0)
    core.step()  # the prompt's blocks taken
    running = core.stats()
    assert (running.waiting, running.running) == (0, 1) and running.free_blocks < idle.free_blocks
    assert running.prefix_queries > idle.prefix_queries
    core.abort(["a"])
    aborted = core.stats()
    assert aborted.idle and aborted.free_blocks == idle.free_blocks
    core.abort(["a"])  # unknown by now: nothing changes
    assert core.stats() is aborted
    core.reset_prefix_cache()
    assert core.stats() is not aborted and core.stats().free_blocks == idle.free_blocks


def test_the_loop_publishes_stats_as_they_are_after_each_command(core) -> None:  # noqa: ANN001
    sent: list[CoreMessage] = []
    waiting: list = []
    loop = CoreLoop(core, sent.append)

    def turn(*commands: object) -> object:
        waiting.extend(commands)
        sent.clear()
        loop.run_once(lambda _: waiting.pop(0) if waiting else None, 0.0)
        return sent[-1]

    first = turn(AddRequests([_request("b"), _request("c")]))
    assert isinstance(first, StepOutputs) and first.stats.running == 2
    answer = turn(AbortRequests(["b"]), Call(1, GetStats()))
    # the call is answered in order, after the abort, before the step that follows
    assert isinstance(sent[0], CallResult) and sent[0].stats.running == 1
    assert isinstance(answer, StepOutputs) and answer.stats.running == 1
    after = turn(AbortRequests(["c"]))
    assert isinstance(after, StepOutputs) and after.outputs == [] and after.stats.idle
    turn(Call(2, ResetPrefixCache()))
    assert isinstance(sent[0], CallResult) and sent[0].stats.idle
    loop.close()
