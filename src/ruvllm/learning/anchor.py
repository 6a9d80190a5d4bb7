"""A KL term toward the base model on the tenant's own everyday text (issue 37, item 2).

EWC++'s pull (background.py) keeps each coordinate near the base by how much the Fisher says it
matters, whatever direction the fact needs; this term instead asks the micro-LoRA to leave the
base model's next-token distributions unchanged on text the tenant actually sends, so the step
itself looks for a change that carries the fact and little else.

Per row of an everyday completion (prompt and output, each row predicting the next token), the
base's distribution is kept coarsened: its top `k` tokens with their log-probabilities and one
bucket for the rest of the vocabulary (computed once, with the full softmax, when the completion is
anchored). The adapter's distribution over the same k + 1 outcomes comes from the step's sampled
softmax (the union of the rows' top tokens exactly, the drawn ones weighed as the rest, as
InstantLearner._logits does), and the term is KL(base || adapter) over those outcomes, averaged over
rows: a lower bound of the full KL (merging outcomes never raises a KL) that is zero exactly where
the adapter leaves the top tokens' probabilities as the base had them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ruvllm.learning.instant import Prepared
from ruvllm.learning.tail import LearnedLayers, MicroLora


@dataclass
class BaseAnchor:
    """One everyday completion, prepared (full context), with the base's coarsened distributions."""

    prep: Prepared
    top: torch.Tensor  # [R, k] the base's top tokens at each row (R: every row but the last)
    logp: torch.Tensor  # [R, k] their log-probabilities under the base (full softmax)
    log_rest: torch.Tensor  # [R] log of the base's probability outside them
    exact: torch.Tensor  # the union of `top`, sorted: the candidates computed exactly
    index: torch.Tensor  # [R, k] each top token's position in `exact`


def make_anchor(layers: LearnedLayers, prep: Prepared, k: int) -> BaseAnchor:
    """The base model's top `k` tokens and log-probabilities at every row of a prepared (full
    context) completion: one forward of the learned layers without a micro-LoRA, one product with
    the whole head."""
    n = prep.prompt_len + len(prep.target)
    with torch.no_grad():
        rows = layers.forward(prep.h, torch.arange(n), None)[:-1]
        logp = (rows @ layers.head.t()).log_softmax(-1)
        top_lp, top = logp.topk(min(k, logp.shape[1]), dim=1)
    exact, inverse = torch.unique(top, return_inverse=True)
    return BaseAnchor(prep, top, top_lp, _log1mexp(top_lp.logsumexp(1)), exact, inverse)


def kl_to_base(layers: LearnedLayers, lora: MicroLora, anchor: BaseAnchor, drawn: int,
               generator: torch.Generator) -> torch.Tensor:
    """KL(base || adapter) over each row's base top tokens and the rest, the rows' mean; the
    adapter's softmax normalised over the exact candidates and `drawn` uniformly drawn tokens that
    stand for the rest of the vocabulary (0: the whole vocabulary, exactly)."""
    prep = anchor.prep
    n = prep.prompt_len + len(prep.target)
    return _kl_of_rows(layers, layers.forward(prep.h, torch.arange(n), lora)[:-1], anchor, drawn, generator)


def kl_mean(layers: LearnedLayers, lora: MicroLora, anchors: list[BaseAnchor], drawn: int,
            generator: torch.Generator) -> torch.Tensor:
    """The mean of `kl_to_base` over the anchors, their rows through the learned layers in one batch
    (LearnedLayers.forward_many: each weight read once for all), the rows they share at their start
    (a chat template's system prompt: 24 of ~70 rows on the default model) computed once and
    continued by each (its rows under the micro-LoRA are the same for all: causal attention); each
    anchor's KL over all its rows, its candidates drawn as kl_to_base draws them."""
    if len(anchors) == 1:
        return kl_to_base(layers, lora, anchors[0], drawn, generator)
    hs = [a.prep.h for a in anchors]
    shared = shared_rows(hs)
    if shared:
        outs = layers.forward_many([hs[0][:shared]] + [h[shared:] for h in hs],
                                   [torch.arange(shared)] + [torch.arange(shared, len(h)) for h in hs], lora,
                                   [None] * (len(hs) + 1), shared_prefix=True)
        outs = [torch.cat([outs[0], out]) for out in outs[1:]]
    else:
        outs = layers.forward_many(hs, [torch.arange(len(h)) for h in hs], lora, [None] * len(anchors))
    return sum(_kl_of_rows(layers, out[:-1], a, drawn, generator) for out, a in zip(outs, anchors)) / len(anchors)


class KlTerm:
    """`weight` times the mean KL toward the base over `anchors` (`mean`: kl_mean, or a stand-in of
    the same arguments), as a step's extra term (Learner._extra): called on a micro-LoRA it is the
    term in autograd's graph; `InstantLearner`'s graphless step instead runs its completions in its
    own pass of the learned layers' C++ calls (`sequences`, `rows_grad`: session 21)."""

    def __init__(self, layers: LearnedLayers, anchors: list[BaseAnchor], weight: float, drawn: int,
                 generator: torch.Generator, mean=None) -> None:  # noqa: ANN001
        self.layers, self.anchors, self.weight, self.drawn, self.generator = layers, anchors, weight, drawn, generator
        self.mean = mean or kl_mean

    def __call__(self, lora: MicroLora) -> torch.Tensor:
        return self.weight * self.mean(self.layers, lora, self.anchors, self.drawn, self.generator)

    def sequences(self, first: int) -> tuple[list[torch.Tensor], list[torch.Tensor], list[int]]:
        """The completions' rows as sequences of one pass (LearnedLayers.whole_pass_many) placed after
        `first` others: (hs, positions, after), with their shared start once, as kl_mean runs them."""
        hs = [a.prep.h for a in self.anchors]
        shared = shared_rows(hs) if len(hs) > 1 else 0
        if not shared:
            return hs, [torch.arange(len(h)) for h in hs], [-1] * len(hs)
        return ([hs[0][:shared]] + [h[shared:] for h in hs], [torch.arange(shared)] +
                [torch.arange(shared, len(h)) for h in hs], [-1] + [first] * len(hs))

    def rows_grad(self, outs: list[torch.Tensor]) -> tuple[float, list[torch.Tensor]]:
        """The term's value and its gradient in each sequence's rows (`sequences`' order), from those
        rows: the KL over each completion's rows as kl_mean takes it (the same ops, draws and order),
        differentiated by autograd from the rows alone (a dozen ops over [rows, candidates]: the
        learned layers' graph is not made). (The drawn candidates pooled into one column, as the
        instant step's softmax does, was tried: 28.8 against 30.6 ms of CPU for this part at one
        thread, within the loaded host's noise; not kept. docs/learning.md "Session 21".)"""
        leaves = [o.detach().requires_grad_() for o in outs]
        with torch.enable_grad():
            # a shared start came first, as its own sequence (`sequences`): one more than the anchors
            shared = len(leaves) == len(self.anchors) + 1
            rows = [torch.cat([leaves[0], own]) for own in leaves[1:]] if shared else leaves
            if len(rows) == 1:
                total = _kl_of_rows(self.layers, rows[0][:-1], self.anchors[0], self.drawn, self.generator)
            else:
                total = sum(_kl_of_rows(self.layers, r[:-1], a, self.drawn, self.generator)
                            for r, a in zip(rows, self.anchors)) / len(self.anchors)
            total = self.weight * total
            grads = torch.autograd.grad(total, leaves)
        return float(total.detach()), list(grads)


def kl_grads(layers: LearnedLayers, lora: MicroLora, term: KlTerm) -> tuple[float, list[torch.Tensor]] | None:
    """`term`'s value at `lora` and its gradients (in `lora.parameters()` order), the completions' rows
    through the learned layers' C++ calls with no autograd graph (the background pass's term computed
    ahead: Learner._ahead), where those calls apply; else None (autograd's graph then: kl_mean)."""
    hs, positions, after = term.sequences(0)
    run = layers.whole_pass_many(hs, positions, lora, [None] * len(hs), after)
    if run is None:
        return None
    value, drows = term.rows_grad(list(run.rows.split(run.sizes)))
    by = {id(p): g for p, g in run.backward(torch.cat(drows))}
    return value, [by[id(p)] if id(p) in by else torch.zeros_like(p) for p in lora.parameters()]


def shared_rows(hs: list[torch.Tensor]) -> int:
    """How many rows all of `hs` begin with alike (the same tokens at the same positions after the
    same tokens: their hidden states equal to within float rounding, which differs with a
    sequence's length where a kernel's is not batch invariant), leaving each at least one row of
    its own. Any other tokens' rows differ by far more than the 1e-4 relative bound."""
    n = min(len(h) for h in hs) - 1
    if n <= 0:
        return 0
    first = hs[0][:n]
    bound = 1e-4 * first.abs().amax(dim=1)
    same = torch.ones(n, dtype=torch.bool)
    for h in hs[1:]:
        same &= (h[:n] - first).abs().amax(dim=1) <= bound
    return n if bool(same.all()) else int((~same).nonzero()[0])


def _kl_of_rows(layers: LearnedLayers, rows: torch.Tensor, anchor: BaseAnchor, drawn: int,
                generator: torch.Generator) -> torch.Tensor:
    head = layers.head
    vocab = head.shape[0]
    if drawn and drawn < vocab:
        others = torch.randint(0, vocab, (drawn,), generator=generator)
        others = others[~torch.isin(others, anchor.exact)]
        bias = torch.zeros(len(anchor.exact) + len(others))
        bias[len(anchor.exact):] = math.log((vocab - len(anchor.exact)) / max(len(others), 1))
        # (index_select: a row copy each, ~6x faster than advanced indexing here; instant.py's _logits)
        logq_all = (rows @ head.index_select(0, torch.cat([anchor.exact, others])).t() + bias).log_softmax(-1)
        logq = logq_all.gather(1, anchor.index)
    else:
        logq = (rows @ head.t()).log_softmax(-1).gather(1, anchor.top)
    logq_rest = _log1mexp(logq.logsumexp(1))
    p = anchor.logp.exp()
    kl = (p * (anchor.logp - logq)).sum(1) + anchor.log_rest.exp() * (anchor.log_rest - logq_rest)
    return kl.mean()


def _log1mexp(x: torch.Tensor) -> torch.Tensor:
    """log(1 - exp(x)) for x <= 0, kept finite where the top tokens hold (nearly) all the mass."""
    return torch.log1p(-x.exp().clamp(max=1 - 1e-6))
