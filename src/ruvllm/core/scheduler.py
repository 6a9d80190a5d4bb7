"""Continuous batching: every step, who runs and with how many tokens, under one token budget.

There is no prefill or decode phase: each request has `num_computed_tokens` and a target (all its
tokens); a step gives some of them a slice of the budget. Running requests go first (in priority
order), then waiting ones are admitted. When the pool runs dry the lowest-priority, latest request
is preempted by recompute: its blocks are freed and it rejoins the queue, to resume later.
"""

from __future__ import annotations

import bisect
import logging
import time
from concurrent.futures import Future

from ruvllm.config import SchedulerConfig
from ruvllm.core.disk_index import DiskLoad, Staged
from ruvllm.core.kv_cache_manager import KVCacheManager
from ruvllm.outputs import ModelRunnerOutput, ScheduledSeq, SchedulerOutput
from ruvllm.request import FinishReason, Request, RequestStatus, scaling_key

log = logging.getLogger(__name__)


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager, max_loras: int = 0,
                 num_lookahead: int = 0) -> None:
        self.config = config
        self.kv = kv
        self.max_loras = max_loras  # adapter slots the running requests may use at once (the worker's)
        self.num_lookahead = num_lookahead  # speculative decoding: proposals per decode step (0: off)
        self.waiting: list[Request] = []  # kept sorted by Request.sort_key
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0
        # Ended since the last schedule(): the next SchedulerOutput tells the worker to forget them.
        self._finished_ids: list[str] = []
        # The disk tier: waiting requests whose prefix blocks the worker's store is reading, by id:
        # (the first block the read covers, the read). A request waits until its read is done.
        self._disk_reads: dict[str, tuple[int, Future[Staged]]] = {}

    # --- queue ---------------------------------------------------------------------------------
    def add(self, req: Request) -> None:
        self.requests[req.request_id] = req
        self._enqueue(req)

    def _enqueue(self, req: Request) -> None:
        bisect.insort(self.waiting, req, key=Request.sort_key)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, req: Request, reason: FinishReason, stop_reason: str | int | None = None) -> None:
        """End a request wherever it is and give back its blocks."""
        if req.is_finished:
            return
        if req.status is RequestStatus.RUNNING:
            self.running.remove(req)
        else:
            self.waiting.remove(req)
        self.kv.free(req)
        self._drop_disk_read(req.request_id)
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        req.stop_reason = stop_reason
        del self.requests[req.request_id]
        self._finished_ids.append(req.request_id)

    # --- one step ------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        cfg = self.config
        budget = cfg.max_num_batched_tokens
        chunk_cap = cfg.long_prefill_token_threshold or budget
        out = SchedulerOutput(finished_ids=self._finished_ids)
        self._finished_ids = []
        # Two-tier KV cache: blocks that left every holder's hot window since the last step move
        # cold now, before this step allocates (the worker copies them before its forward pass).
        out.kv_moves = self.kv.migrate_cold(self.running)
        scheduled: list[tuple[Request, int, int]] = []  # (request, tokens, lookahead)

        self.running.sort(key=Request.sort_key)
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = min(req.num_tokens - req.num_computed_tokens, budget, chunk_cap)
            # A decode may score proposals too, when its blocks can take them without preempting.
            k = self._lookahead(req, budget) if n == req.num_tokens - req.num_computed_tokens == 1 else 0
            if k and not self.kv.allocate_slots(req, n + k):
                k = 0
            while not k and not self.kv.allocate_slots(req, n):
                victim = self.running[-1]  # lowest priority, latest arrival, not yet scheduled
                self._preempt(victim)
                out.preempted.append(victim.request_id)
                if victim is req:
                    break
            else:
                scheduled.append((req, n, k))
                budget -= n + k
                i += 1

        if not out.preempted:
            # every adapter the running requests hold, stacked ones included: each takes its own slots
            adapters = {a.name: a.slots for r in self.running for a in r.adapter_runs}
            for req in list(self.waiting):
                if budget == 0 or len(self.running) >= cfg.max_num_seqs:
                    break
                if self._waits_for_sibling(req):
                    continue
                if req.grammar is not None and not req.grammar_ready:  # its compile runs beside the loop
                    continue
                # The slots hold adapters running requests use: this one waits for slots.
                new = {a.name: a.slots for a in req.adapter_runs if a.name not in adapters}
                if new and sum(adapters.values()) + sum(new.values()) > self.max_loras:
                    continue
                # Prompt logprobs and mean pooling need every prompt position computed: no prefix-cache hits.
                full_prompt = req.params.prompt_logprobs is not None or req.pools_every_row
                hits, hit_tokens = ([], 0) if full_prompt else self.kv.get_computed_blocks(req)
                # The disk tier: blocks after the memory hits that were written to disk are read
                # (off this thread) while the request waits, then loaded instead of computed.
                disk = (None, 0, 0, 0) if full_prompt or self.kv.disk is None else self._disk_blocks(req, len(hits))
                if disk is None:
                    continue
                staged, loaded, looked_up, first = disk
                hit_tokens += loaded * self.kv.block_size
                n = req.num_tokens - hit_tokens
                if n > budget and not cfg.enable_chunked_prefill:
                    break
                n = min(n, budget, chunk_cap)
                if not self.kv.allocate_slots(req, n + loaded * self.kv.block_size, hits):
                    break
                self.waiting.remove(req)
                req.num_computed_tokens = hit_tokens
                if self.kv.disk is not None and not full_prompt:
                    self._disk_reads.pop(req.request_id, None)
                    self.kv.count_disk_lookup(looked_up, loaded * self.kv.block_size)
                    if staged is not None and loaded:
                        table = self.kv.block_table(req.request_id)
                        out.kv_loads.append(DiskLoad(table[len(hits):len(hits) + loaded], staged, first))
                        self.kv.cache_full_blocks(req)  # they hold their K/V once loaded: findable at once
                if req.status is RequestStatus.WAITING:
                    req.num_cached_tokens = hit_tokens
                    req.first_scheduled_time = time.monotonic()
                req.status = RequestStatus.RUNNING
                self.running.append(req)
                adapters.update(new)
                scheduled.append((req, n, 0))
                budget -= n

        # Cached blocks this step's allocations evicted: the worker writes them to disk first.
        out.kv_spills = self.kv.take_spills()
        for req, n, k in scheduled:
            start = req.num_computed_tokens
            tables = self.kv.block_tables(req.request_id)
            out.seqs.append(ScheduledSeq(
                request_id=req.request_id,
                token_ids=req.token_slice(start, start + n),
                start_position=start,
                block_table=tables[0],
                group_block_tables=tables[1:],
                sample=start + n == req.num_tokens,
                prompt_logprob_targets=self._prompt_logprob_targets(req, start, n),
                adapter=req.adapter.name if req.adapter else None,
                stacked=tuple(a.name for a in req.stacked),
                scaling_block_table=self.kv.block_table(scaling_key(req.request_id)) if req.scaling_pass else None,
                num_lookahead=k,
                pool=req.pooling is not None,
            ))
        return out

    def _disk_blocks(self, req: Request, num_hits: int) -> tuple[Staged | None, int, int, int] | None:
        """The disk tier's part of an admission after `num_hits` memory hits: None while a read of
        the following blocks runs (the request waits); else (the staged blocks or None, how many
        of them to load, prompt tokens looked up on disk, the first staged block to load)."""
        rid = req.request_id
        if req.adapter is not None:  # an adapter's blocks never go to disk (KVCacheManager._disk_seed)
            return None, 0, 0, 0
        lookup = max(0, (req.num_tokens - 1) // self.kv.block_size - num_hits) * self.kv.block_size
        pending = self._disk_reads.get(rid)
        if pending is None:
            wanted = self.kv.disk_lookup(req, num_hits)
            if not wanted:
                return None, 0, lookup, 0
            self._disk_reads[rid] = (num_hits, self.kv.disk.fetch(wanted))  # type: ignore[union-attr]
            return None
        first, read = pending
        if not read.done():
            return None
        try:
            staged = read.result()
        except Exception as e:  # a read that failed outright: the tokens are computed instead
            log.warning("the disk KV tier's read for request %s failed: %s", rid, e)
            del self._disk_reads[rid]
            return None, 0, lookup, 0
        # Memory hits may have changed while the read ran: staged block j is block first + j; those
        # before num_hits are in memory now, and a gap before `first` means computing from there.
        if num_hits < first:
            return None, 0, lookup, 0
        return staged, max(0, first + staged.num_blocks - num_hits), lookup, num_hits - first

    def _drop_disk_read(self, rid: str) -> None:
        pending = self._disk_reads.pop(rid, None)
        if pending is not None:
            pending[1].cancel()

    @property
    def disk_reads(self) -> list[Future[Staged]]:
        """The disk reads waiting requests wait for (the core waits on them when nothing else runs)."""
        return [read for _, read in self._disk_reads.values()]

    def _lookahead(self, req: Request, budget: int) -> int:
        """Proposals a decoding request may have scored this step: K, or fewer where its max_tokens,
        the context or the step's budget leave less room (all its new tokens must fit)."""
        if not self.num_lookahead or req.scaling_pass or req.pooling is not None:  # (an embedding never decodes)
            return 0
        p = req.params
        room = [self.num_lookahead, budget - 1, req.max_total_tokens - req.num_tokens - 1]
        if p.max_tokens is not None:
            room.append(p.max_tokens - len(req.output_token_ids) - 1)
        return max(0, min(room))

    @staticmethod
    def _prompt_logprob_targets(req: Request, start: int, n: int) -> tuple[int, list[int]] | None:
        """Row i of the chunk predicts token start+i+1. Returns (first row, prompt tokens to score from
        it on), skipping positions already scored before a preemption."""
        if req.params.prompt_logprobs is None:
            return None
        lo = max(start + 1, 1 + req.num_prompt_logprobs)
        hi = min(start + n + 1, req.num_prompt_tokens)
        if lo >= hi:
            return None
        return lo - start - 1, req.prompt_token_ids[lo:hi]

    def _waits_for_sibling(self, req: Request) -> bool:
        """n > 1: later copies wait until the first has its prompt cached, then share its blocks."""
        sib = req.prompt_sibling
        return (self.kv.enable_prefix_caching and sib is not None and sib.status is RequestStatus.RUNNING
                and sib.num_computed_tokens < sib.num_prompt_tokens)

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.kv.free(req)
        self._drop_disk_read(req.request_id)
        req.num_computed_tokens = 0
        req.status = RequestStatus.PREEMPTED
        req.num_preemptions += 1
        self.num_preemptions += 1
        self._enqueue(req)

    def update(self, so: SchedulerOutput, ro: ModelRunnerOutput) -> list[Request]:
        """Account for the computed tokens, append sampled ones, finish what is done.

        Returns the requests that received a token or prompt logprobs this step (finished ones included)."""
        touched = []
        for seq in so.seqs:
            req = self.requests[seq.request_id]
            scored = ro.prompt_logprobs.get(req.request_id)
            if scored:
                req.num_prompt_logprobs += len(scored)
            if not seq.sample:
                req.num_computed_tokens += len(seq.token_ids)
                self.kv.cache_full_blocks(req)
                if scored:
                    touched.append(req)
                continue
            if seq.pool:
                # An embedding's last chunk ran: the worker pooled its vector (ro.pooled). Its full
                # blocks are valid K/V and enter the prefix cache as any prompt's do; finishing frees
                # them at once (KVCacheManager.free: to be handed out first).
                req.num_computed_tokens += len(seq.token_ids)
                self.kv.cache_full_blocks(req)
                touched.append(req)
                self.finish(req, FinishReason.STOP)
                continue
            # One token, or with speculation the accepted proposals and one more: every token but the
            # last has its K/V computed now (a proposal is accepted only where it equals the token).
            stop = None
            req.num_new_tokens = 0
            for token in ro.sampled[req.request_id]:
                req.output_token_ids.append(token)
                req.num_new_tokens += 1
                stop = self._stop(req, token)
                if stop is not None:
                    break
            req.num_computed_tokens += len(seq.token_ids) + req.num_new_tokens - 1
            self.kv.cache_full_blocks(req)
            touched.append(req)
            if stop is not None:
                self.finish(req, *stop)
            elif seq.num_lookahead:
                self.kv.trim(req)  # blocks that only held rejected proposals go back to the pool
        return touched

    @staticmethod
    def _stop(req: Request, token: int) -> tuple[FinishReason, int | None] | None:
        """Why the request ends with this output token, if it does."""
        p = req.params
        n_out = len(req.output_token_ids)
        if n_out >= p.min_tokens:
            if not p.ignore_eos and token in req.eos_token_ids:
                return FinishReason.STOP, None
            if p.stop_token_ids and token in p.stop_token_ids:
                return FinishReason.STOP, token
        if (p.max_tokens is not None and n_out >= p.max_tokens) or req.num_tokens >= req.max_total_tokens:
            return FinishReason.LENGTH, None
        return None
