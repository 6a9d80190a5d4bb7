"""What proposes speculative tokens: prompt lookup or a draft model, behind one interface. Each
proposer owns what it keeps per sequence (an n-gram index, the draft's computed positions)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from ruvllm.layers.sampler import SamplingState
from ruvllm.outputs import ScheduledSeq
from ruvllm.speculative.ngram import NgramIndex
from ruvllm.speculative.verify import Proposal

# How many of `offered` proposals a sequence takes now (the adaptive policy's choice, or all).
Length = Callable[[str, int], int]


class Proposer(Protocol):
    def propose(self, seqs: list[tuple[ScheduledSeq, SamplingState]], length: Length) -> dict[str, Proposal]:
        """Proposals for decoding sequences that have room (ScheduledSeq.num_lookahead)."""
        ...

    def accepted(self, request_id: str, position: int, num_accepted: int) -> None:
        """After verification: of the proposals written after `position`, `num_accepted` were kept."""
        ...

    def preempted(self, request_id: str) -> None:
        """The sequence's blocks were freed (its K/V is gone; its tokens are not)."""
        ...

    def forget(self, request_id: str) -> None:
        """The sequence ended."""
        ...


class NgramProposer:
    """Prompt lookup (ngram.py): the tokens that followed the latest earlier occurrence of the
    sequence's last n tokens; the policy then takes as many of those found as it wants."""

    def __init__(self, n_min: int, n_max: int) -> None:
        self.n_min, self.n_max = n_min, n_max
        self._index: dict[str, NgramIndex] = {}

    def propose(self, seqs: list[tuple[ScheduledSeq, SamplingState]], length: Length) -> dict[str, Proposal]:
        proposals = {}
        for seq, state in seqs:
            index = self._index.get(seq.request_id)
            if index is None:
                index = self._index[seq.request_id] = NgramIndex(self.n_min, self.n_max)
            index.extend(state.token_slice(len(index.tokens)))
            tokens = index.propose(seq.num_lookahead)
            tokens = tokens[:length(seq.request_id, len(tokens))]
            if tokens:
                proposals[seq.request_id] = Proposal(tokens)
        return proposals

    def accepted(self, request_id: str, position: int, num_accepted: int) -> None:
        pass  # the index follows the sequence's tokens, which hold only what was accepted

    def preempted(self, request_id: str) -> None:
        pass  # tokens survive a preemption

    def forget(self, request_id: str) -> None:
        self._index.pop(request_id, None)
