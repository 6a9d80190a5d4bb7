"""A step's sampling, proposals or not: each sequence's rows are sampled in order, and a sequence
goes on to its next row only while the token its own sampling chose equals the proposal there.

Row i of a sequence holds the target's logits after its token and its first i proposals. It is
sampled exactly as an ordinary decode step would be (penalties, logit bias, min tokens and the
grammar mask see the tokens accepted before it; a seeded sequence draws the same noise), so:
- a proposal without a distribution (prompt lookup; a greedy draft) is a point mass, and sampling
  p then keeping the proposal only if it was drawn is exact rejection sampling for it: accepted
  with probability p(token), and on rejection the token drawn is distributed as p without it.
  Greedy and seeded sampling give the very tokens they give without speculation.
- a proposal drawn from a draft distribution q takes sampler.accept_or_resample's test instead.
Rows are batched across sequences at each depth; a step with no proposal is one sample() call.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ruvllm.layers.sampler import SamplingState, sample
from ruvllm.request import Logprob

log = logging.getLogger(__name__)


@dataclass
class Proposal:
    tokens: list[int]
    # [len(tokens), V]: the draft distribution each token was drawn from (None: point masses)
    probs: torch.Tensor | None = None


def sample_rows(logits: torch.Tensor, counts: list[int], states: list[SamplingState],
                proposals: list[Proposal | None], generator: torch.Generator | None,
                to_host: Callable[[torch.Tensor], list[int]] | None = None
                ) -> tuple[list[list[int]], list[list[dict[int, Logprob] | None]]]:
    """logits: [sum(counts), V] float32, counts[i] = 1 + len(proposals[i].tokens) consecutive rows of
    sequence i. Returns each sequence's new tokens (its accepted proposals and one more) and their
    logprobs, and appends the tokens to the states (output tokens, grammar matchers). `to_host`:
    how the first row's tokens reach the host (sampler.sample's)."""
    starts = [0]
    for c in counts:
        starts.append(starts[-1] + c)
    tokens: list[list[int]] = [[] for _ in states]
    logprobs: list[list[dict[int, Logprob] | None]] = [[] for _ in states]
    active = list(range(len(states)))
    depth = 0
    while active:
        rows = logits if len(active) == logits.shape[0] else logits[[starts[i] + depth for i in active]]
        reqs = [states[i] for i in active]
        drafts = [_draft(proposals[i], depth) for i in active]
        chosen, lps = sample(rows, reqs, generator, drafts if any(d is not None for d in drafts) else None,
                             to_host if depth == 0 else None)
        still = []
        for i, token, lp in zip(active, chosen, lps):
            _append(states[i], token)
            tokens[i].append(token)
            logprobs[i].append(lp)
            prop = proposals[i]
            if prop is not None and depth < len(prop.tokens) and token == prop.tokens[depth]:
                still.append(i)
        active = still
        depth += 1
    return tokens, logprobs


def _draft(prop: Proposal | None, depth: int) -> tuple[int, torch.Tensor] | None:
    if prop is None or prop.probs is None or depth >= len(prop.tokens):
        return None
    return prop.tokens[depth], prop.probs[depth]


def _append(state: SamplingState, token: int) -> None:
    state.output_token_ids.append(token)
    m = state.matcher
    if m is not None and not m.is_terminated() and not m.accept_token(token):  # masked to what it accepts
        log.warning("request %s: its grammar refused token %d; the rest of it is unconstrained", state.request_id, token)
        state.matcher = None
