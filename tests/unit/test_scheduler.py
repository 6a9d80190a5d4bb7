"""Scheduler driven with the real KVCacheManager; the model is replaced by hand-built ModelRunnerOutput."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from ruvllm.config import SchedulerConfig
from ruvllm.core.kv_cache_manager import KVCacheManager
from ruvllm.core.scheduler import Scheduler
from ruvllm.outputs import ModelRunnerOutput, SchedulerOutput
from ruvllm.request import FinishReason, Priority, Request, RequestStatus
from ruvllm.sampling_params import SamplingParams

EOS = 2


def make(num_blocks: int = 64, block_size: int = 4, budget: int = 64, max_seqs: int = 16,
         chunked: bool = True, prefix: bool = True) -> Scheduler:
    kv = KVCacheManager(num_blocks, block_size, prefix)
    cfg = SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_seqs, enable_chunked_prefill=chunked)
    return Scheduler(cfg, kv)


_arrival = iter(range(10**9))


def mk(rid: str, n_prompt: int, start: int = 100, priority: Priority = Priority.NORMAL,
       **params) -> Request:
    params.setdefault("ignore_eos", True)
    return Request(rid, list(range(start, start + n_prompt)), SamplingParams(**params),
                   eos_token_ids=(EOS,), priority=priority, arrival=next(_arrival))


def default_token(req: Request) -> int:
    return 1000 + len(req.output_token_ids)  # deterministic, never EOS


def step(s: Scheduler, token: Callable[[Request], int] = default_token) -> SchedulerOutput:
    so = s.schedule()
    sampled = {seq.request_id: [token(s.requests[seq.request_id])] for seq in so.seqs if seq.sample}
    s.update(so, ModelRunnerOutput(sampled, {}))
    return so


def check_seqs(s: Scheduler, so: SchedulerOutput) -> None:
    """Each scheduled slice is the next uncomputed tokens of its request, and the block table covers it."""
    for seq in so.seqs:
        r = s.requests.get(seq.request_id)
        if r is None:  # finished during update
            continue
        assert len(seq.block_table) * s.kv.block_size >= seq.start_position + len(seq.token_ids)


def run(s: Scheduler, max_steps: int = 500) -> list[SchedulerOutput]:
    outs = []
    while s.has_work:
        assert len(outs) < max_steps, "scheduler made no progress"
        outs.append(step(s))
    return outs


def ids(so: SchedulerOutput) -> list[str]:
    return [seq.request_id for seq in so.seqs]


# ------------------------------------------------------------------------------------- budget, chunking


def test_token_budget_respected_and_all_tokens_computed_once() -> None:
    s = make(num_blocks=256, budget=24, max_seqs=4)
    reqs = [mk(f"r{i}", n, start=100 * i, max_tokens=m)
            for i, (n, m) in enumerate([(5, 7), (30, 3), (50, 1), (1, 9), (17, 4), (24, 2)])]
    for r in reqs:
        s.add(r)
    computed: dict[str, int] = {r.request_id: 0 for r in reqs}
    steps = 0
    while s.has_work:
        so = s.schedule()
        assert 0 < so.num_tokens <= 24
        assert len(so.seqs) <= 4
        for seq in so.seqs:
            r = s.requests[seq.request_id]
            assert seq.start_position == r.num_computed_tokens == computed[r.request_id]
            assert seq.token_ids == r.all_token_ids[seq.start_position:seq.start_position + len(seq.token_ids)]
            assert seq.sample == (seq.start_position + len(seq.token_ids) == r.num_tokens)
            computed[r.request_id] += len(seq.token_ids)
        sampled = {seq.request_id: [default_token(s.requests[seq.request_id])] for seq in so.seqs if seq.sample}
        s.update(so, ModelRunnerOutput(sampled, {}))
        steps += 1
        assert steps < 200
    for r in reqs:
        assert r.finish_reason is FinishReason.LENGTH
        assert len(r.output_token_ids) == r.params.max_tokens
        assert computed[r.request_id] == r.num_tokens - 1  # every token but the last sampled one
    assert s.kv.num_free_blocks == 256


def test_long_prompt_is_chunked_and_only_last_chunk_samples() -> None:
    s = make(budget=16)
    r = mk("a", 40, max_tokens=2)
    s.add(r)
    outs = [step(s) for _ in range(3)]
    assert [(o.seqs[0].start_position, len(o.seqs[0].token_ids), o.seqs[0].sample) for o in outs] == [
        (0, 16, False), (16, 16, False), (32, 8, True)]
    assert r.output_token_ids == [1000]
    assert r.num_computed_tokens == 40
    nxt = step(s)
    assert (nxt.seqs[0].start_position, nxt.seqs[0].token_ids, nxt.seqs[0].sample) == (40, [1000], True)


def test_decodes_and_prefill_chunk_share_a_step() -> None:
    s = make(budget=16)
    a = mk("a", 4, max_tokens=10)
    b = mk("b", 5, start=200, max_tokens=10)
    s.add(a)
    s.add(b)
    step(s)  # both prompts in one step
    c = mk("c", 40, start=300, max_tokens=2)
    s.add(c)
    so = step(s)
    assert ids(so) == ["a", "b", "c"]
    assert [len(x.token_ids) for x in so.seqs] == [1, 1, 14]
    assert [x.sample for x in so.seqs] == [True, True, False]
    assert so.num_tokens == 16


def test_long_prefill_threshold_caps_chunk() -> None:
    kv = KVCacheManager(64, 4, True)
    s = Scheduler(SchedulerConfig(max_num_batched_tokens=32, long_prefill_token_threshold=8), kv)
    s.add(mk("a", 20, max_tokens=1))
    s.add(mk("b", 20, start=500, max_tokens=1))
    so = step(s)
    assert [len(x.token_ids) for x in so.seqs] == [8, 8]


def test_max_num_seqs_caps_running() -> None:
    s = make(budget=64, max_seqs=2)
    reqs = [mk(f"r{i}", 3, start=10 * i, max_tokens=3) for i in range(3)]
    for r in reqs:
        s.add(r)
    so = step(s)
    assert ids(so) == ["r0", "r1"]
    assert len(s.running) == 2 and s.waiting == [reqs[2]]
    step(s)
    assert reqs[2].status is RequestStatus.WAITING
    so = step(s)  # r0 and r1 finish here (third token)
    assert reqs[0].is_finished and reqs[1].is_finished
    so = step(s)
    assert ids(so) == ["r2"]
    while s.has_work:
        assert len(s.running) <= 2
        step(s)


def test_admission_order_priority_then_arrival() -> None:
    s = make(max_seqs=1)
    order = [("low0", Priority.LOW), ("high1", Priority.HIGH), ("norm2", Priority.NORMAL),
             ("high3", Priority.HIGH), ("crit4", Priority.CRITICAL), ("norm5", Priority.NORMAL)]
    for i, (rid, pr) in enumerate(order):
        s.add(mk(rid, 3, start=10 * i, priority=pr, max_tokens=1))
    assert [r.request_id for r in s.waiting] == ["crit4", "high1", "high3", "norm2", "norm5", "low0"]
    served = [ids(so)[0] for so in run(s)]
    assert served == ["crit4", "high1", "high3", "norm2", "norm5", "low0"]


# ------------------------------------------------------------------------------------- preemption


def test_preemption_picks_lowest_priority_latest_arrival_and_resumes() -> None:
    # 8 blocks of 4: three requests of 8 prompt tokens take 6, decodes soon run the pool dry.
    s = make(num_blocks=8, block_size=4, budget=64, prefix=False)
    hi = mk("hi", 8, start=100, priority=Priority.HIGH, max_tokens=8)  # arrives last, but high priority
    n0 = mk("n0", 8, start=200, max_tokens=8)
    n1 = mk("n1", 8, start=300, max_tokens=8)
    s.add(n0)
    s.add(n1)
    s.add(hi)
    step(s)
    assert {r.status for r in (hi, n0, n1)} == {RequestStatus.RUNNING}
    so = step(s)  # 9th token needs a third block for each: only 2 free
    assert so.preempted == ["n1"]
    assert n1.status is RequestStatus.PREEMPTED
    assert n1.num_computed_tokens == 0
    assert s.kv.block_table("n1") == []
    assert n1 in s.waiting and n1 not in s.running
    assert n1.num_preemptions == 1 and s.num_preemptions == 1
    assert ids(so) == ["hi", "n0"]  # no admission in a step that preempted
    assert n1.output_token_ids == [1000]  # generated tokens are kept
    outs = run(s)
    for r in (hi, n0, n1):
        assert r.finish_reason is FinishReason.LENGTH
        assert r.output_token_ids == [1000 + i for i in range(8)]
    # when it resumes it recomputes prompt + generated tokens in one chunk
    resumed = next(x for o in outs for x in o.seqs if x.request_id == "n1")
    assert resumed.start_position == 0 and resumed.token_ids[8:] == n1.output_token_ids[:len(resumed.token_ids) - 8]
    assert s.kv.num_free_blocks == 8


def test_preempted_request_resumes_from_prefix_hits() -> None:
    """c has a's prompt; admitted in the same step they do not share. Once c is preempted, its
    recompute is served from a's cached blocks."""
    s = make(num_blocks=8, block_size=4, budget=64, prefix=True)
    a = mk("a", 8, start=100, max_tokens=8)
    b = mk("b", 8, start=200, max_tokens=8)
    c = mk("c", 8, start=100, max_tokens=8)
    for r in (a, b, c):
        s.add(r)
    step(s)
    assert c.num_cached_tokens == 0
    so = step(s)
    assert so.preempted == ["c"]
    so = step(s)
    assert ids(so) == ["a", "b", "c"]
    resumed = so.seqs[2]
    assert (resumed.start_position, resumed.token_ids, resumed.sample) == (8, [1000], True)
    assert s.kv.block_table("c")[:2] == s.kv.block_table("a")[:2]
    assert c.status is RequestStatus.RUNNING
    assert c.num_cached_tokens == 0  # set on first admission only
    run(s)
    assert c.output_token_ids == a.output_token_ids == [1000 + i for i in range(8)]
    assert s.kv.num_free_blocks == 8


def test_request_alone_that_outgrows_pool_preempts_itself() -> None:
    s = make(num_blocks=2, block_size=4, budget=64)
    a = mk("a", 8, max_tokens=4)
    s.add(a)
    step(s)
    so = s.schedule()
    assert so.preempted == ["a"] and so.seqs == []
    assert a.status is RequestStatus.PREEMPTED and s.kv.num_free_blocks == 2


# ------------------------------------------------------------------------------------- finish


def test_finish_running_and_waiting_frees_blocks() -> None:
    s = make(num_blocks=16, block_size=4, budget=64, max_seqs=1)
    a = mk("a", 10, max_tokens=5)
    b = mk("b", 10, start=500, max_tokens=5)
    s.add(a)
    s.add(b)
    step(s)
    assert s.kv.num_free_blocks == 13 and b.status is RequestStatus.WAITING
    s.finish(a, FinishReason.ABORT)
    assert a.status is RequestStatus.FINISHED and a.finish_reason is FinishReason.ABORT
    assert a not in s.running and "a" not in s.requests
    assert s.kv.num_free_blocks == 16
    s.finish(a, FinishReason.STOP)  # no-op
    assert a.finish_reason is FinishReason.ABORT
    s.finish(b, FinishReason.ABORT)
    assert b not in s.waiting and not s.has_work
    assert s.schedule().is_empty


def test_finish_preempted_request() -> None:
    s = make(num_blocks=2, block_size=4)
    a = mk("a", 8, max_tokens=4)
    s.add(a)
    step(s)
    s.schedule()
    assert a.status is RequestStatus.PREEMPTED
    s.finish(a, FinishReason.ABORT)
    assert not s.has_work and s.kv.num_free_blocks == 2


# ------------------------------------------------------------------------------------- stop conditions


def drive(r: Request, tokens: list[int]) -> list[int]:
    """Run `r` alone, sampling `tokens` in turn; returns what it generated."""
    s = make()
    s.add(r)
    it = iter(tokens)
    while s.has_work:
        step(s, lambda _r: next(it))
    return r.output_token_ids


def test_eos_stops() -> None:
    r = mk("a", 3, ignore_eos=False, max_tokens=10)
    assert drive(r, [5, 6, EOS, 7, 8]) == [5, 6, EOS]
    assert (r.finish_reason, r.stop_reason) == (FinishReason.STOP, None)


def test_ignore_eos() -> None:
    r = mk("a", 3, ignore_eos=True, max_tokens=4)
    assert drive(r, [EOS] * 10) == [EOS] * 4
    assert r.finish_reason is FinishReason.LENGTH


def test_stop_token_ids() -> None:
    r = mk("a", 3, stop_token_ids=[9, 11], max_tokens=10)
    assert drive(r, [5, 11, 9]) == [5, 11]
    assert (r.finish_reason, r.stop_reason) == (FinishReason.STOP, 11)


def test_max_tokens_is_length() -> None:
    r = mk("a", 3, ignore_eos=False, max_tokens=3)
    assert drive(r, [5, 6, 7, 8]) == [5, 6, 7]
    assert (r.finish_reason, r.stop_reason) == (FinishReason.LENGTH, None)


def test_min_tokens_suppresses_eos_and_stop_tokens() -> None:
    r = mk("a", 3, ignore_eos=False, min_tokens=3, stop_token_ids=[9], max_tokens=10)
    assert drive(r, [EOS, 9, EOS, 7]) == [EOS, 9, EOS]
    assert r.finish_reason is FinishReason.STOP
    r = mk("b", 3, ignore_eos=False, min_tokens=3, stop_token_ids=[9], max_tokens=10)
    assert drive(r, [EOS, 9, 9, 7]) == [EOS, 9, 9]
    assert r.stop_reason == 9


def test_context_length_cap_is_length() -> None:
    r = Request("a", [5, 6, 7], SamplingParams(max_tokens=None), max_total_tokens=6)
    assert drive(r, [1, 1, 1, 1, 1]) == [1, 1, 1]
    assert r.finish_reason is FinishReason.LENGTH


# ------------------------------------------------------------------------------------- chunked prefill off


def test_without_chunked_prefill_a_prompt_waits_for_room() -> None:
    s = make(budget=16, chunked=False)
    a = mk("a", 10, max_tokens=5)
    b = mk("b", 10, start=500, max_tokens=5)
    s.add(a)
    s.add(b)
    so = step(s)
    assert ids(so) == ["a"] and b.status is RequestStatus.WAITING  # 10 > 6 left: not chunked
    so = step(s)
    assert ids(so) == ["a", "b"]
    assert (so.seqs[1].start_position, len(so.seqs[1].token_ids), so.seqs[1].sample) == (0, 10, True)


def test_with_chunked_prefill_the_same_prompt_is_chunked() -> None:
    s = make(budget=16, chunked=True)
    s.add(mk("a", 10, max_tokens=5))
    s.add(mk("b", 10, start=500, max_tokens=5))
    so = step(s)
    assert [(x.request_id, len(x.token_ids), x.sample) for x in so.seqs] == [("a", 10, True), ("b", 6, False)]


# ------------------------------------------------------------------------------------- n > 1


def test_siblings_wait_for_first_prompt_then_share_its_blocks() -> None:
    s = make(num_blocks=64, block_size=4, budget=8)
    first = mk("p#0", 20, max_tokens=3)
    second = mk("p#1", 20, max_tokens=3)
    second.prompt_sibling = first
    s.add(first)
    s.add(second)
    for _ in range(3):  # 8 + 8 + 4 prompt tokens: the sibling waits although the budget would fit it
        so = step(s)
        assert ids(so) == ["p#0"]
        assert second.status is RequestStatus.WAITING
    assert first.num_computed_tokens == 20
    so = step(s)
    assert ids(so) == ["p#0", "p#1"]
    sib = so.seqs[1]
    assert (sib.start_position, len(sib.token_ids), sib.sample) == (16, 4, True)
    assert second.num_cached_tokens == 16
    ta, tb = s.kv.block_table("p#0"), s.kv.block_table("p#1")
    assert ta[:4] == tb[:4] and ta[4] != tb[4]
    assert all(s.kv.pool.blocks[i].ref_count == 2 for i in ta[:4])
    run(s)
    assert first.output_token_ids == second.output_token_ids == [1000, 1001, 1002]


def test_siblings_do_not_wait_without_prefix_caching() -> None:
    s = make(budget=64, prefix=False)
    first = mk("p#0", 20, max_tokens=1)
    second = mk("p#1", 20, max_tokens=1)
    second.prompt_sibling = first
    s.add(first)
    s.add(second)
    assert ids(step(s)) == ["p#0", "p#1"]


@pytest.mark.parametrize("prefix", [True, False])
def test_everything_is_freed_after_a_mixed_workload(prefix: bool) -> None:
    s = make(num_blocks=12, block_size=4, budget=12, max_seqs=3, prefix=prefix)
    reqs = [mk(f"r{i}", n, start=(i % 2) * 1000, priority=Priority(i % 3), max_tokens=m)
            for i, (n, m) in enumerate([(9, 6), (14, 4), (3, 12), (20, 2), (9, 6)])]
    for r in reqs:
        s.add(r)
    for so in run(s):
        assert so.num_tokens <= 12
        check_seqs(s, so)
    assert all(len(r.output_token_ids) == r.params.max_tokens for r in reqs)
    assert s.kv.num_free_blocks == 12


def test_token_slice_equals_slicing_all_tokens() -> None:
    from ruvllm.request import Request
    from ruvllm.sampling_params import SamplingParams
    r = Request("s", [1, 2, 3, 4], SamplingParams())
    r.output_token_ids = [5, 6, 7]
    for start in range(8):
        for end in range(start, 8):
            assert r.token_slice(start, end) == r.all_token_ids[start:end]
