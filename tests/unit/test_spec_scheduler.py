"""Speculative decoding in the scheduler: room for proposals, accepted tokens, blocks given back.
The real KVCacheManager; the model is replaced by hand-built ModelRunnerOutputs (what a worker
returns when it accepted some proposals)."""

from __future__ import annotations

from ruvllm.config import SchedulerConfig
from ruvllm.core.kv_cache_manager import KVCacheManager
from ruvllm.core.scheduler import Scheduler
from ruvllm.outputs import ModelRunnerOutput
from ruvllm.request import FinishReason, Request
from ruvllm.sampling_params import SamplingParams

BS = 4


def make(num_blocks: int = 64, budget: int = 64, lookahead: int = 4) -> Scheduler:
    kv = KVCacheManager(num_blocks, BS, True)
    return Scheduler(SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=8), kv, num_lookahead=lookahead)


def req(rid: str, n_prompt: int = 6, **params) -> Request:
    params.setdefault("ignore_eos", True)
    return Request(rid, list(range(100, 100 + n_prompt)), SamplingParams(**params), eos_token_ids=(2,))


def prefill(s: Scheduler, r: Request) -> None:
    s.add(r)
    so = s.schedule()
    assert so.seqs[0].num_lookahead == 0  # a prompt chunk scores no proposals
    s.update(so, ModelRunnerOutput({r.request_id: [50]}, {}))


def test_a_decode_gets_room_for_k_proposals_and_keeps_what_was_accepted() -> None:
    s = make()
    r = req("a")
    prefill(s, r)  # 6 prompt tokens + 1 output
    so = s.schedule()
    seq = so.seqs[0]
    assert (seq.token_ids, seq.start_position, seq.num_lookahead) == ([50], 6, 4)
    assert len(seq.block_table) * BS >= 6 + 1 + 4  # blocks for the token and 4 proposals
    # the worker proposed 4, two were accepted, then its own token: 3 new tokens
    s.update(so, ModelRunnerOutput({"a": [51, 52, 53]}, {}, num_proposed={"a": 4}))
    assert r.output_token_ids == [50, 51, 52, 53]
    assert r.num_computed_tokens == 6 + 1 + 2  # the token and the 2 accepted proposals; 53 is not computed
    assert r.num_new_tokens == 3
    # the blocks past the request's tokens (the rejected proposals') are back in the pool
    assert len(s.kv.block_table("a")) == s.kv.num_blocks_needed(r.num_tokens)
    assert s.kv.num_free_blocks == 64 - s.kv.num_blocks_needed(r.num_tokens)


def test_room_shrinks_to_max_tokens_the_context_and_the_budget() -> None:
    s = make(budget=64)
    r = req("a", max_tokens=3)
    prefill(s, r)
    assert s.schedule().seqs[0].num_lookahead == 1  # 1 output so far: 2 more at most, one of them its own
    s2 = make(budget=3)
    r2 = req("b", n_prompt=2)
    prefill(s2, r2)
    assert s2.schedule().seqs[0].num_lookahead == 2  # 3 tokens of budget: the token and 2 proposals
    s3 = make()
    r3 = req("c")
    r3.max_total_tokens = 9
    prefill(s3, r3)  # 7 tokens
    assert s3.schedule().seqs[0].num_lookahead == 1


def test_a_stop_among_accepted_tokens_ends_there() -> None:
    s = make()
    r = req("a", ignore_eos=False)
    prefill(s, r)
    so = s.schedule()
    s.update(so, ModelRunnerOutput({"a": [51, 2, 53]}, {}, num_proposed={"a": 4}))  # 2 is EOS
    assert r.output_token_ids == [50, 51, 2]
    assert r.finish_reason is FinishReason.STOP and r.num_new_tokens == 2
    assert s.kv.num_free_blocks == 64


def test_no_room_without_speculation_or_when_blocks_are_short() -> None:
    s = make(lookahead=0)
    prefill(s, req("a"))
    assert s.schedule().seqs[0].num_lookahead == 0
    s = make(num_blocks=2)  # 8 slots: the prompt and its token fit, 4 proposals would not
    r = req("b")
    prefill(s, r)
    so = s.schedule()
    assert so.seqs[0].num_lookahead == 0 and not so.preempted  # speculation never preempts anyone
