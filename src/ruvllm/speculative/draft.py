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

import torch

from ruvllm.layers.sampler import SamplingState
from ruvllm.outputs import ScheduledSeq
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

    def accepted(self, request_id: str, position: int, num_accepted: int) -> None:
        """After verification: of the proposals written after `position`, only the accepted ones hold
        the sequence's real tokens."""
        if request_id in self.computed:
            self.computed[request_id] = min(self.computed[request_id], position + 1 + num_accepted)

    @torch.inference_mode()
    def propose(self, seqs: list[tuple[ScheduledSeq, SamplingState]]) -> dict[str, Proposal]:
        """Proposals for decoding sequences (each ScheduledSeq: one token at start_position, room for
        num_lookahead more). A sequence still catching up this step proposes nothing."""
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
        if not chunks:
            return {}
        hidden = self.runner._forward(chunks, None, scaling_tables=False)
        rows, end = [], 0
        for c in chunks:
            end += len(c.token_ids)
            if c.sample:
                rows.append(end - 1)
        if not ready:
            return {}
        logits = self.runner._logits(hidden, rows)
        states = [s for _, s in ready]
        proposals = {seq.request_id: Proposal([], [] if s.params.temperature != 0 else None) for seq, s in ready}
        live = list(range(len(ready)))
        rolled = [0] * len(ready)  # proposals each matcher accepted, to roll back at the end
        for depth in range(max(seq.num_lookahead for seq, _ in ready)):
            tokens, probs = self._draw(logits, [states[i] for i in live])
            for j, i in enumerate(live):
                prop = proposals[ready[i][0].request_id]
                prop.tokens.append(tokens[j])
                if prop.probs is not None:
                    prop.probs.append(probs[j])
                m = states[i].matcher
                if m is not None and not m.is_terminated() and m.accept_token(tokens[j]):
                    rolled[i] += 1
            live = [i for i in live if len(proposals[ready[i][0].request_id].tokens) < ready[i][0].num_lookahead]
            if not live:
                break
            step = []
            for i in live:
                seq = ready[i][0]
                k = len(proposals[seq.request_id].tokens)
                step.append(ScheduledSeq(seq.request_id, [proposals[seq.request_id].tokens[-1]],
                                         seq.start_position + k, seq.block_table, sample=True))
                self.computed[seq.request_id] = seq.start_position + k + 1
            logits = self.runner._logits(self.runner._forward(step, None, scaling_tables=False), list(range(len(step))))
        for i, (_, state) in enumerate(ready):
            if rolled[i] and state.matcher is not None:
                state.matcher.rollback(rolled[i])
        for prop in proposals.values():
            if prop.probs is not None:
                prop.probs = torch.stack(prop.probs)
        return proposals

    def _draw(self, logits: torch.Tensor, states: list[SamplingState]) -> tuple[list[int], list[torch.Tensor | None]]:
        """The draft's next token per row: argmax for greedy requests, else drawn from q, the draft's
        distribution at the request's temperature (under its grammar's mask, when it has one)."""
        logits = logits.float()
        if has_grammar(states):
            logits = logits.clone()
            apply_grammar_masks(logits, states)
        tokens = logits.argmax(dim=-1).tolist()
        probs: list[torch.Tensor | None] = [None] * len(states)
        for j, s in enumerate(states):
            t = s.params.temperature
            if t == 0:
                continue
            q = (logits[j] / t).softmax(dim=-1)
            gen = s.generator or self.generator
            noise = torch.empty(q.shape, dtype=q.dtype, device=gen.device).exponential_(generator=gen).to(q.device)
            tokens[j] = int((q / noise).argmax())
            probs[j] = q
        return tokens, probs

