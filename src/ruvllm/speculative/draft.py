"""The draft-model proposer: a smaller model with the target's tokenizer, run by our own model
runner on a paged KV pool of its own.

The draft pool has as many blocks as the target's and is addressed by the target's block tables, so
a sequence's draft K/V sits at the same block and offset as its target K/V: the scheduler's
allocation covers both, and freeing, preemption and prefix sharing need nothing of their own (a
block shared through the prefix cache gets the same draft K/V from every holder, the same tokens at
the same positions). Each sequence's draft K/V is valid up to `computed` positions; a step first
catches the draft up on what it has not seen (the prompt, the target's last token, proposals it did
not make), in chunks under a token budget, then proposes K tokens in K batched one-token passes."""

from __future__ import annotations

import dataclasses

import torch

from ruvllm.layers.sampler import SamplingState, exponential_race
from ruvllm.outputs import ScheduledSeq
from ruvllm.speculative.proposer import Length
from ruvllm.speculative.verify import Proposal
from ruvllm.structured.bitmask import apply_grammar_masks, has_grammar
from ruvllm.worker.model_runner import ModelRunner


class DraftProposer:
    def __init__(self, runner: ModelRunner, catch_up_budget: int, seed: int = 0) -> None:
        self.runner = runner
        self.catch_up_budget = catch_up_budget  # draft tokens of catching up per step, over all sequences
        # Draws the proposals of unseeded sampling requests (seeded ones draw from their own generator).
        self.generator = torch.Generator(device=runner.device).manual_seed(seed ^ 0x5EED)
        self.computed: dict[str, int] = {}  # request id -> leading positions whose draft K/V is valid

    def forget(self, request_id: str) -> None:
        """The sequence ended, or was preempted (its blocks were freed): its draft K/V is gone."""
        self.computed.pop(request_id, None)

    preempted = forget

    def accepted(self, request_id: str, position: int, num_accepted: int) -> None:
        """After verification: of the proposals written after `position`, only the accepted ones hold
        the sequence's real tokens."""
        if request_id in self.computed:
            self.computed[request_id] = min(self.computed[request_id], position + 1 + num_accepted)

    @torch.inference_mode()
    def propose(self, seqs: list[tuple[ScheduledSeq, SamplingState]], length: Length) -> dict[str, Proposal]:
        """Proposals for decoding sequences (each ScheduledSeq: one token at start_position, room for
        num_lookahead more, of which `length` takes what its passes are worth: 0 still catches the
        draft up). A sequence still catching up this step proposes nothing."""
        seqs = [(dataclasses.replace(seq, num_lookahead=length(seq.request_id, seq.num_lookahead)), state)
                for seq, state in seqs]
        budget = self.catch_up_budget
        chunks: list[ScheduledSeq] = []
        ready: list[tuple[ScheduledSeq, SamplingState]] = []
        for seq, state in seqs:
            n = seq.start_position
            done = min(self.computed.get(seq.request_id, 0), n)
            todo = n + 1 - done
            take = min(todo, budget)
            if take <= 0:
                continue
            budget -= take
            proposes = take == todo and seq.num_lookahead > 0  # 0: only catching up this step
            chunks.append(ScheduledSeq(seq.request_id, state.token_slice(done, done + take), done, seq.block_table,
                                       sample=proposes))
            self.computed[seq.request_id] = done + take
            if proposes:
                ready.append((seq, state))
        rows, end = [], 0
        for c in chunks:
            end += len(c.token_ids)
            if c.sample:
                rows.append(end - 1)
        if not chunks:
            return {}
        logits = self.runner.logits_at(chunks, rows)  # the catch-up chunks' pass, whoever proposes
        if not ready:
            return {}
        states = [s for _, s in ready]
        tokens: list[list[int]] = [[] for _ in ready]
        qs: list[list[torch.Tensor]] = [[] for _ in ready]
        rolled = [0] * len(ready)  # proposals each matcher accepted, to roll back at the end
        live = list(range(len(ready)))
        while live:
            drawn, probs = self._draw(logits, [states[i] for i in live])
            for j, i in enumerate(live):
                tokens[i].append(drawn[j])
                if probs is not None and states[i].params.temperature != 0:
                    qs[i].append(probs[j])
                m = states[i].matcher
                if m is not None and not m.is_terminated() and m.accept_token(drawn[j]):
                    rolled[i] += 1
            live = [i for i in live if len(tokens[i]) < ready[i][0].num_lookahead]
            step = []
            for i in live:  # each feeds its latest proposal back, at the position after the last
                seq = ready[i][0]
                position = seq.start_position + len(tokens[i])
                step.append(ScheduledSeq(seq.request_id, [tokens[i][-1]], position, seq.block_table, sample=True))
                self.computed[seq.request_id] = position + 1
            if step:
                logits = self.runner.logits_at(step, list(range(len(step))))
        for i, state in enumerate(states):
            if rolled[i] and state.matcher is not None:
                state.matcher.rollback(rolled[i])
        return {seq.request_id: Proposal(tokens[i], torch.stack(qs[i]) if qs[i] else None)
                for i, (seq, _) in enumerate(ready)}

    def _draw(self, logits: torch.Tensor, states: list[SamplingState]) -> tuple[list[int], torch.Tensor | None]:
        """The draft's next token per row: argmax for greedy requests, else drawn from q, the draft's
        distribution at the request's temperature (under its grammar's mask, when it has one).
        Returns the tokens and q for every row (None when no row samples; greedy rows' q unused)."""
        logits = logits.float()
        if has_grammar(states):
            logits = logits.clone()
            apply_grammar_masks(logits, states)
        chosen = logits.argmax(dim=-1)
        sampled = [j for j, s in enumerate(states) if s.params.temperature != 0]
        if not sampled:
            return chosen.tolist(), None
        temps = torch.tensor([max(s.params.temperature, 1e-6) for s in states], device=logits.device)
        probs = (logits / temps.unsqueeze(1)).softmax(dim=-1)
        index = torch.tensor(sampled, device=logits.device)
        chosen[index] = exponential_race(probs[index], [states[j] for j in sampled], self.generator)
        return chosen.tolist(), probs
