"""Turn a batch of logits into next tokens, each row with its own sampling settings.

Work is vectorised across rows; the only per-row loops are over rows that ask for something
(a logit bias, a seed), and a seeded row draws its noise from its own generator, so its output does
not depend on what else shares the batch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from ruvllm.request import Logprob, slice_tokens
from ruvllm.sampling_params import SamplingParams
from ruvllm.structured.bitmask import apply_grammar_masks, has_grammar


@dataclass(eq=False)
class SamplingState:
    """What the sampler reads of one sequence. The worker keeps one per sequence from its first step
    to its end (preemptions included): the seeded generator's position and the output tokens that
    penalties and min-tokens count live here, not in the scheduler."""

    request_id: str
    params: SamplingParams
    prompt_token_ids: list[int]
    eos_token_ids: tuple[int, ...] = ()
    output_token_ids: list[int] = field(default_factory=list)
    generator: torch.Generator | None = None
    # The request's grammar (structured outputs): an xgrammar matcher, advanced by each output token
    matcher: Any = None
    # Penalties' state, built on first use and kept up to date with the output tokens since, so a
    # step costs one small update per penalized row rather than a recount of its whole output.
    _counts: torch.Tensor | None = field(default=None, repr=False)
    _counted: int = 0
    _prompt_mask: torch.Tensor | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.params.seed is not None and self.generator is None:
            self.generator = torch.Generator().manual_seed(self.params.seed)

    def token_slice(self, start: int, end: int | None = None) -> list[int]:
        """The sequence's tokens (prompt, then output) [start, end) without building the whole list."""
        prompt, out = self.prompt_token_ids, self.output_token_ids
        return slice_tokens(prompt, out, start, len(prompt) + len(out) if end is None else end)

    def token_counts(self, vocab: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        """[vocab]: how often each token is in the output so far."""
        if self._counts is None:
            self._counts = torch.zeros(vocab, dtype=dtype, device=device)
        new = self.output_token_ids[self._counted:]
        if len(new) == 1:  # the usual step: one token, no host-to-device copy of an index tensor
            self._counts[new[0]] += 1
        elif new:
            self._counts.index_add_(0, torch.tensor(new, device=device), torch.ones(len(new), dtype=dtype, device=device))
        self._counted = len(self.output_token_ids)
        return self._counts

    def prompt_mask(self, vocab: int, device: torch.device) -> torch.Tensor:
        """[vocab]: whether each token is in the prompt (the repetition penalty's prompt part)."""
        if self._prompt_mask is None:
            self._prompt_mask = torch.zeros(vocab, dtype=torch.bool, device=device)
            self._prompt_mask[torch.tensor(self.prompt_token_ids, dtype=torch.long, device=device)] = True
        return self._prompt_mask


def apply_penalties(logits: torch.Tensor, reqs: list[SamplingState]) -> None:
    """Repetition (on prompt and output, CTRL style), presence and frequency (on output) penalties."""
    rows = [i for i, r in enumerate(reqs) if r.params.needs_penalties()]
    if not rows:
        return
    vocab, dev = logits.shape[1], logits.device
    sub = logits[rows]
    counts = torch.stack([reqs[i].token_counts(vocab, dev, logits.dtype) for i in rows])
    rep = torch.tensor([reqs[i].params.repetition_penalty for i in rows], dtype=logits.dtype, device=dev).unsqueeze(1)
    if any(reqs[i].params.repetition_penalty != 1.0 for i in rows):
        seen = torch.stack([reqs[i].prompt_mask(vocab, dev) for i in rows]) | (counts > 0)
        penalised = torch.where(sub > 0, sub / rep, sub * rep)
        sub = torch.where(seen, penalised, sub)
    freq = torch.tensor([reqs[i].params.frequency_penalty for i in rows], dtype=logits.dtype, device=dev).unsqueeze(1)
    pres = torch.tensor([reqs[i].params.presence_penalty for i in rows], dtype=logits.dtype, device=dev).unsqueeze(1)
    sub = sub - freq * counts - pres * (counts > 0).to(logits.dtype)
    logits[rows] = sub


def apply_bans_and_bias(logits: torch.Tensor, reqs: list[SamplingState]) -> None:
    for i, r in enumerate(reqs):
        p = r.params
        if p.logit_bias:
            ids = torch.tensor(list(p.logit_bias.keys()), dtype=torch.long, device=logits.device)  # checked on admission
            logits[i, ids] += torch.tensor(list(p.logit_bias.values()), dtype=logits.dtype, device=logits.device)
        if len(r.output_token_ids) < p.min_tokens:
            banned = list(p.stop_token_ids or []) + ([] if p.ignore_eos else list(r.eos_token_ids))
            if banned:
                logits[i, banned] = float("-inf")


def truncate(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Mask (to -inf) tokens outside each row's top-k / top-p nucleus / min-p floor."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    vocab = logits.shape[1]
    ranks = torch.arange(vocab, device=logits.device).unsqueeze(0)
    k = torch.where(top_k > 0, top_k, vocab).unsqueeze(1)
    drop = ranks >= k
    # top-p and min-p look at the distribution that top-k left (renormalised), as HF and vLLM do.
    probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1)
    # Keep a token if the mass before it is below top_p (so the top token always stays).
    before = probs.cumsum(dim=-1) - probs
    drop |= before >= top_p.unsqueeze(1)
    drop |= probs < (min_p.unsqueeze(1) * probs[:, :1])
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


def sample(logits: torch.Tensor, reqs: list[SamplingState], generator: torch.Generator | None = None,
           drafts: list[tuple[int, torch.Tensor] | None] | None = None,
           to_host: Callable[[torch.Tensor], list[int]] | None = None
           ) -> tuple[list[int], list[dict[int, Logprob] | None]]:
    """logits: [B, V] float32, one row per request. Returns the chosen tokens and optional logprobs.

    Rows without a seed draw from `generator` (the engine's, seeded from its config), or torch's
    global generator when none is given.

    drafts (speculative decoding with a draft model): per row, None or (token, q), a token the
    draft drew from its distribution q [V]. Such a row keeps the token with probability
    min(1, p(token) / q(token)), p being the row's own distribution after every setting, and
    otherwise draws from the residual max(p - q, 0), renormalised (Leviathan et al. 2023;
    Chen et al. 2023): its token is distributed as p whatever q is.

    to_host: turns the chosen tokens (a device tensor) into a list; by default `tolist()`. The CUDA
    graphs pass theirs, which launches the next step between the copy and the wait for it, so
    every kernel that reads this step's logits is queued before that function is called."""
    want_lp = [r.params.logprobs for r in reqs]
    raw_logprobs = logits.log_softmax(dim=-1) if any(n is not None for n in want_lp) else None

    adjusted = any(r.params.logit_bias or len(r.output_token_ids) < r.params.min_tokens or r.params.needs_penalties()
                   for r in reqs)
    constrained = has_grammar(reqs)
    if adjusted or constrained:
        logits = logits.clone()  # the caller's logits stay as the model gave them
    if adjusted:
        apply_bans_and_bias(logits, reqs)
        apply_penalties(logits, reqs)
    if constrained:
        apply_grammar_masks(logits, reqs)

    dev = logits.device
    chosen = logits.argmax(dim=-1)
    sampled = [i for i, r in enumerate(reqs) if r.params.temperature != 0]
    if sampled:
        rows = torch.tensor(sampled, dtype=torch.long, device=dev)
        sub_reqs = [reqs[i] for i in sampled]
        probs = target_probs(logits[rows], sub_reqs)
        chosen[rows] = exponential_race(probs, sub_reqs, generator)
        if drafts is not None:
            for j, i in enumerate(sampled):
                if drafts[i] is not None:
                    chosen[i] = accept_or_resample(probs[j], *drafts[i], reqs[i].generator or generator)

    tokens = chosen.tolist() if to_host is None else to_host(chosen)
    logprobs: list[dict[int, Logprob] | None] = [None] * len(reqs)
    if raw_logprobs is not None:
        rows = [i for i, n in enumerate(want_lp) if n is not None]
        entries = token_logprobs(raw_logprobs[rows], [tokens[i] for i in rows], [want_lp[i] for i in rows],
                                 [reqs[i].params.logprob_token_ids for i in rows])
        for i, entry in zip(rows, entries):
            logprobs[i] = entry
    return tokens, logprobs


def exponential_race(probs: torch.Tensor, reqs: list[SamplingState], generator: torch.Generator | None
                     ) -> torch.Tensor:
    """One draw per row of probs [B, V]: argmax(p / E), E ~ Exp(1) (Gumbel-max in another form).
    A seeded request's row draws its noise from its own generator, which lives on the CPU, so its
    draws are the same on any device and whatever shares the batch."""
    noise = torch.empty_like(probs).exponential_(generator=generator)
    for j, r in enumerate(reqs):
        if r.generator is not None:
            noise[j] = torch.empty(probs.shape[1], dtype=probs.dtype).exponential_(generator=r.generator).to(probs.device)
    return (probs / noise).argmax(dim=-1)


def target_probs(logits: torch.Tensor, reqs: list[SamplingState]) -> torch.Tensor:
    """The distribution each sampling row draws from: temperature, then top-k / top-p / min-p."""
    dev = logits.device
    temps = torch.tensor([r.params.temperature for r in reqs], dtype=logits.dtype, device=dev)
    sub = logits / temps.unsqueeze(1)
    if any(r.params.needs_truncation() for r in reqs):
        sub = truncate(
            sub,
            # top_k past the vocabulary means off; clamped so it always fits a tensor.
            torch.tensor([min(r.params.top_k, logits.shape[1]) for r in reqs], device=dev),
            torch.tensor([r.params.top_p for r in reqs], dtype=logits.dtype, device=dev),
            torch.tensor([r.params.min_p for r in reqs], dtype=logits.dtype, device=dev),
        )
    return sub.softmax(dim=-1)


def accept_or_resample(p: torch.Tensor, token: int, q: torch.Tensor, generator: torch.Generator | None) -> int:
    """One step of speculative sampling: `token` was drawn from q; keep it with probability
    min(1, p/q) at it, else draw from the normalised residual max(p - q, 0). A rejection needs
    p(token) < q(token), so the residual never holds the token itself."""
    q = q.to(p.device, p.dtype)
    gen_dev = torch.device("cpu") if generator is None else generator.device
    u = torch.rand((), generator=generator, device=gen_dev).item()
    if u * float(q[token]) <= float(p[token]):
        return token
    residual = (p - q).clamp_(min=0)
    if float(residual.sum()) <= 0:  # p == q up to rounding: p itself is the residual's limit
        residual = p.clone()
        residual[token] = 0
    noise = torch.empty_like(residual, device=gen_dev).exponential_(generator=generator).to(p.device)
    return int((residual / noise).argmax())


def token_logprobs(logprobs: torch.Tensor, tokens: list[int], top_n: list[int],
                   wanted: list[tuple[int, ...] | None] | None = None) -> list[dict[int, Logprob]]:
    """For each row: the logprob and rank of `tokens[i]`, plus the row's `top_n[i]` most likely tokens
    and the tokens `wanted[i]` names (SamplingParams.logprob_token_ids), each read off its own row alone."""
    if not tokens:
        return []
    ids = torch.tensor(tokens, dtype=torch.long, device=logprobs.device)
    chosen = logprobs.gather(1, ids.unsqueeze(1))
    ranks = ((logprobs > chosen).sum(dim=1) + 1).tolist()
    chosen_l = chosen.squeeze(1).tolist()
    k = max(top_n)
    top_vals, top_ids = logprobs.topk(k, dim=1) if k > 0 else (None, None)
    out = []
    for i, tok in enumerate(tokens):
        entry = {tok: Logprob(tok, chosen_l[i], ranks[i])}
        if top_n[i] > 0:
            for rank, (tid, val) in enumerate(zip(top_ids[i, : top_n[i]].tolist(), top_vals[i, : top_n[i]].tolist()), 1):
                entry.setdefault(tid, Logprob(tid, val, rank))
        if wanted is not None and wanted[i]:
            ids_i = torch.tensor(wanted[i], dtype=torch.long, device=logprobs.device)
            vals = logprobs[i].index_select(0, ids_i)
            wanted_ranks = ((logprobs[i].unsqueeze(0) > vals.unsqueeze(1)).sum(dim=1) + 1).tolist()
            for tid, val, rank in zip(wanted[i], vals.tolist(), wanted_ranks):
                entry.setdefault(tid, Logprob(tid, val, rank))
        out.append(entry)
    return out
