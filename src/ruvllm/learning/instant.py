"""The instant loop: one gradient step of a tenant's micro-LoRA per feedback event.

The step's loss is over the target tokens only (the correction, or the completion's own output):
cross-entropy toward them (a correction, a positive score) or unlikelihood, -log(1 - p), away from
them (a negative score), weighted by |score|. Two choices cut its cost, both measured in
docs/learning.md:
- `context`: "frozen" takes the prompt's hidden states and K/V in the learned layers as computed
  without the micro-LoRA and learns through the target rows alone (the prompt's rows are computed
  once per completion and kept); "full" runs every row through the learned layers with gradients.
- `candidates`: the softmax over the whole vocabulary (0), or over the target tokens and that many
  others drawn at random per step (a sampled softmax: the LM head's cost shrinks with it).
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
import torch.nn.functional as F

from ruvllm.learning.candidates import CandidatePool
from ruvllm.learning.config import InstantConfig
from ruvllm.learning.sampled_logits import sampled_logits
from ruvllm.learning.tail import LearnedLayers, MicroLora, hidden_before

if TYPE_CHECKING:
    from ruvllm.learning.bank import PromptEmbedder


@dataclass
class Prepared:
    """What one (prompt, target) pair needs for any number of steps: computed once."""

    prompt_len: int
    target: list[int]
    # hidden states entering the learned layers: of every token ("full"), or ("frozen") of the rows
    # that predict the target: the prompt's last token and the target's but its last
    h: torch.Tensor
    # ("frozen") each learned layer's K/V of the prompt's tokens before its last
    context: list[tuple[torch.Tensor, torch.Tensor]] | None
    seconds: float
    frozen: bool = False
    # the pattern bank's embedding of the prompt (bank.PromptEmbedder), where the learner has one
    embedding: torch.Tensor | None = None
    # the base model's top tokens at the target's rows, always among the sampled softmax's candidates
    negatives: torch.Tensor | None = None
    # the sampled softmax's exact candidates (the target's and `negatives`' tokens), found once: the
    # same for every step on this pair (InstantLearner._exact)
    exact: Exact | None = None


class Exact(NamedTuple):
    """The sampled softmax's exact candidates of one (target, negatives): their token ids, sorted
    and unique; each target token's index among them; a vocabulary-wide table of them, in which
    the step looks its drawn tokens up; and their head rows, gathered once (a contiguous copy)."""

    ids: torch.Tensor
    index: torch.Tensor
    hit: torch.Tensor
    rows: torch.Tensor


@dataclass
class StepTiming:
    forward_backward: float
    optimizer: float
    loss: float  # the feedback's loss as the event found it (before its first step)
    steps: int = 1  # gradient steps the event took
    final_loss: float | None = None  # the loss before the event's last step
    losses: list[float] | None = None  # (step_events) each event's own loss as it found it, in order


@dataclass
class AheadTerm:
    """A term of the step computed ahead, off the feedback's path (learner.py: the KL toward the
    base, after the scope's last change): its gradients at the weights `at`, from `sources` (the
    anchors it was made of). Valid for a step that starts from exactly these weights."""

    at: list[torch.Tensor]
    sources: tuple
    grads: list[torch.Tensor]

    def fits(self, lora: MicroLora, sources: tuple) -> bool:
        return len(sources) == len(self.sources) and all(a is b for a, b in zip(sources, self.sources)) \
            and all(torch.equal(w, p) for w, p in zip(self.at, lora.parameters()))


@dataclass
class TenantState:
    lora: MicroLora
    opt: torch.optim.Optimizer
    anchor: list[torch.Tensor]  # theta*: the base model's behaviour (MicroLora.base_point; EWC++)
    fisher: list[torch.Tensor] | None = None  # the online diagonal Fisher, per parameter
    steps: int = 0
    since_fisher: int = 0  # instant updates (step or step_events calls) since the Fisher was last refreshed
    ahead: AheadTerm | None = None  # the KL term's gradients computed after the last change (learner.py)


class InstantLearner:
    def __init__(self, layers: LearnedLayers, config: InstantConfig, embedder: PromptEmbedder | None = None) -> None:
        self.layers = layers
        self.config = config
        self.embedder = embedder  # each prepared prompt's embedding for the pattern bank (None: none)
        # the sampled softmax's drawn candidates, a batch a step: made ahead by the learner's
        # background pass (Learner.consolidate: fill_candidates), else drawn in the step (candidates.py)
        self.candidates = CandidatePool(layers.head, config.seed, config.candidates_ahead)
        # the sampled softmax's drawn candidates pooled by our C++ (learning/sampled_logits.py; None:
        # torch's ops): the kernels where the learned layers run them
        self.logits_ext = layers._ext
        # `step`'s default form with no autograd graph (_many_by_hand); False: the graph always (its
        # reference, and the benchmark's arm for the learner before it)
        self.graphless = True
        # the KL term toward the base (anchor.KlTerm) in the same graphless pass, its completions
        # beside the events' rows (_many_by_hand; session 21); False: in autograd's graph as before
        self.graphless_kl = True

    def fill_candidates(self) -> int:
        """Draw and gather the next steps' candidates now, off the feedback's path (the pool's
        `keep` batches ready). Returns how many batches were made."""
        c = self.config
        if not c.candidates or c.candidates >= self.layers.head.shape[0]:
            return 0
        return self.candidates.fill(c.candidates)

    def new_tenant(self, seed: int, tensors: dict[str, torch.Tensor] | None = None) -> TenantState:
        """A tenant's learning state: a fresh micro-LoRA, or one starting from PEFT `tensors` (a
        served version). Either way EWC++ pulls toward the base point (B = 0), never toward where it
        starts. Raises KeyError/RuntimeError when the tensors do not fit its layers, targets or rank."""
        c = self.config
        lora = MicroLora.create(self.layers.cfg, self.layers.layers, c.targets, c.rank, c.alpha, seed)
        if tensors is not None:
            lora.load_peft_tensors(tensors)
        # fused: one kernel over all the parameters; the default per-tensor loop over the two dozen
        # small ones took ~6 ms a step on a loaded 2-core host, fused ~0.5 ms (docs/learning.md)
        return TenantState(lora, torch.optim.Adam(lora.parameters(), lr=c.lr, fused=True), lora.base_point())

    def prepare(self, prompt: list[int], target: list[int], context_mode: str | None = None) -> Prepared:
        """The hidden states entering the learned layers (the layers below run as inference), and
        with a frozen context the prompt's K/V through the learned layers."""
        t = time.perf_counter()
        ids = prompt + target
        h = hidden_before(self.layers.model, ids, self.layers.first)
        embedding = self.embedder(h[:len(prompt)], prompt) if self.embedder is not None else None
        context = None
        frozen = (context_mode or self.config.context) == "frozen"
        if frozen:
            before = len(prompt) - 1
            if before:
                kv: list = []
                with torch.no_grad():
                    self.layers.forward(h[:before], torch.arange(before), None, keep_kv=kv)
                context = kv
            h = h[before:len(ids) - 1]
        prep = Prepared(len(prompt), target, h, context, time.perf_counter() - t, frozen, embedding)
        if self.config.hard_negatives and self.config.candidates:
            with torch.no_grad():
                # The served head's logits (its packed copy where the engine has one: ~13 ms for 12
                # rows where the float32 table, 113 MB read, took ~55; session 23): the tokens the
                # model as served prefers (their top 32 a row shared 97-100% with the float table's, mean
                # 99.1%, over 33 rows of three chat pairs).
                logits = self.layers.model.compute_logits(self._rows(prep, None)).float()
                logits[torch.arange(len(target)), torch.tensor(target)] = float("-inf")
                k = min(self.config.hard_negatives, logits.shape[1])
                prep.negatives = torch.unique(logits.topk(k, dim=1).indices)
            if self.config.estimate_rest:
                prep.exact = self._exact(torch.tensor(target), prep.negatives)
            prep.seconds = time.perf_counter() - t
        return prep

    def _rows(self, prep: Prepared, lora: MicroLora | None) -> torch.Tensor:
        """The final-normed hidden states of the rows that predict the target, under `lora`."""
        n_prompt, n = prep.prompt_len, len(prep.target)
        if prep.frozen:
            return self.layers.forward(prep.h, torch.arange(n_prompt - 1, n_prompt - 1 + n), lora, prep.context)
        return self.layers.forward(prep.h, torch.arange(n_prompt + n), lora, keep_from=n_prompt - 1)[:-1]

    def step(self, state: TenantState, prep: Prepared, score: float,
             extra: Callable[[MicroLora], torch.Tensor] | None = None,
             ahead: list[torch.Tensor] | None = None) -> StepTiming:
        """Adam steps of the tenant's micro-LoRA toward (score > 0) or away from the target, on the
        feedback's loss (EWC++ is `consolidate`'s pull, off the feedback's path) plus `extra`'s term
        of the micro-LoRA if given (learning/anchor.py's KL toward the base; not in the loss
        reported): one, or up to `steps_per_event` while a target token's loss (toward it) is still
        over `target_nll`. `ahead`: the gradients of a further term at the state's weights as they
        are now, computed ahead (AheadTerm), added to the gradient; with one step an event only
        (a second step would need the term at new weights)."""
        c = self.config
        assert ahead is None or c.steps_per_event == 1, "a term computed ahead holds for one step"
        labels = torch.tensor(prep.target)
        fb = opt = 0.0
        first = last = None
        taken = 0
        kl = self._kl_term(extra)
        while True:
            t0 = time.perf_counter()
            by_hand = self._many_by_hand(state, [(prep, score)], kl, ahead) if extra is None or kl is not None \
                else None
            if by_hand is not None:
                (last,), (nll,), descend = by_hand
            else:
                logits, index = self._logits(self._rows(prep, state.lora), labels, prep.negatives, prep.exact)
                if score >= 0:
                    nll = F.cross_entropy(logits, index, reduction="none")
                    loss = nll.mean() * max(score, 1e-3)
                else:
                    loss = feedback_loss(logits, index, score)
                last = float(loss.detach())
                descend = functools.partial(_descend, state, loss, extra, ahead, self.logits_ext)
            if score >= 0:
                done = taken and float(nll.detach().max()) < c.target_nll
            else:
                done = taken > 0  # pushing away has no target to reach: one step
            first = last if first is None else first
            if done:
                fb += time.perf_counter() - t0  # (this forward only checked the loss)
                break
            t1 = descend()
            taken += 1
            fb, opt = fb + t1 - t0, opt + time.perf_counter() - t1
            if taken >= c.steps_per_event:
                break
        return StepTiming(fb, opt, first, taken, last)

    def _kl_term(self, extra: Callable[[MicroLora], torch.Tensor] | None) -> Any:
        """`extra` where it is the KL term alone (anchor.KlTerm over kl_mean) and `graphless_kl`: the
        graphless step can run it in its own pass; else None."""
        from ruvllm.learning.anchor import KlTerm, kl_mean

        if self.graphless_kl and isinstance(extra, KlTerm) and extra.mean is kl_mean:
            return extra
        return None

    def _many_by_hand(self, state: TenantState, events: list[tuple[Prepared, float]], kl: Any,
                      ahead: list[torch.Tensor] | None
                      ) -> tuple[list[float], list[torch.Tensor], Callable[[], float]] | None:
        """`step`'s (one event) or `step_events`' forward and loss with no autograd graph, where it
        applies (the default update: frozen contexts through the learned layers' C++ calls, the
        sampled softmax with the drawn candidates pooled, no extra term but the KL term `kl`
        (anchor.KlTerm), `graphless`): (each event's loss, each event's rows' -log p of their labels,
        the descent, which runs the layers' backward call, sets each piece's .grad, adds `ahead` and
        steps Adam, returning when the backward ended). Else None: the step builds the graph.
        Several events' rows and the KL term's completions (after their shared start) run as
        sequences of one pass (LearnedLayers.whole_pass_many: each weight read once for all, each
        sequence attending to its own context; session 21); the loss is the mean of the events' plus
        the KL term, whose candidates are drawn in the descent, after the events', as the graph's
        step draws them. The loss and every gradient are the graph's up to float rounding
        (tests/unit/test_learning_whole.py); what it removes is the graph's nodes, their Python and
        the exact product and cross-entropy as torch ops (docs/learning.md "Session 20", "Session 21")."""
        c, head, ext = self.config, self.layers.head, self.logits_ext
        n, vocab = c.candidates, head.shape[0]
        if not self.graphless or not all(p.frozen for p, _ in events) or not n or n >= vocab or not c.estimate_rest \
                or ext is None or head.shape[1] % 8 or head.dtype != torch.float32:
            return None
        hs, positions, contexts, after = [], [], [], []
        for p, _ in events:
            start = p.prompt_len - 1
            hs.append(p.h)
            positions.append(torch.arange(start, start + len(p.target)))
            contexts.append(p.context)
            after.append(-1)
        if kl is not None:
            k_hs, k_positions, k_after = kl.sequences(len(hs))
            hs, positions, contexts, after = hs + k_hs, positions + k_positions, contexts + [None] * len(k_hs), \
                after + k_after
        run = self.layers.whole_pass_many(hs, positions, state.lora, contexts, after)
        if run is None:
            return None
        outs = list(run.rows.split(run.sizes)) if len(hs) > 1 else [run.rows]
        losses, nlls, drows = [], [], []
        for out, (p, score) in zip(outs, events):
            exact = p.exact if p.exact is not None else self._exact(torch.tensor(p.target), p.negatives)
            drawn = self.candidates.take(n)  # (as _logits: made ahead, or drawn now)
            clash = exact.hit.index_select(0, drawn.tokens)
            bias = math.log((vocab - len(exact.ids)) / max(n - int(clash.sum()), 1))
            loss, nll, d = ext.sampled_loss(out.contiguous(), exact.rows.contiguous(), drawn.rows.contiguous(),
                                            torch.full((n,), bias), clash.contiguous(), exact.index.contiguous(),
                                            float(score))
            losses.append(float(loss))
            nlls.append(nll)
            drows.append(d if len(events) == 1 else d / len(events))  # (the events' mean)

        def descend() -> float:
            grads = drows
            if kl is not None:  # (its candidates drawn now, after the events': the graph's order)
                grads = grads + kl.rows_grad(outs[len(events):])[1]
            state.opt.zero_grad()
            for p, g in run.backward(grads[0] if len(grads) == 1 else torch.cat(grads)):
                p.grad = g
            _add_grads(state.lora, ahead)
            t1 = time.perf_counter()
            adam_step(state.opt, ext)
            state.steps += 1
            return t1
        return losses, nlls, descend

    def step_events(self, state: TenantState, events: list[tuple[Prepared, float]],
                    extra: Callable[[MicroLora], torch.Tensor] | None = None,
                    ahead: list[torch.Tensor] | None = None) -> StepTiming:
        """One Adam step of the tenant's micro-LoRA over several feedback events at once (a backlog
        coalesced, issue 37 item 3): the loss is the mean of the events' losses, plus `extra`'s term
        once (the KL term toward the base is the same for every event of a tenant, so the mean of
        the events' `step` losses has it once: computed once here, where one step each computes it
        per event). Every event's rows run through the learned layers as one batch
        (LearnedLayers.forward_many: no padding), so each weight is read once for all of them, each
        event attending to its own rows: a full-context event's whole sequence, a frozen-context
        one's target rows after its prompt's kept K/V.
        `ahead`: as `step`'s. Returns the mean first loss (without `extra`'s term) and each event's own
        in `losses`."""
        t0 = time.perf_counter()
        kl = self._kl_term(extra)
        by_hand = self._many_by_hand(state, events, kl, ahead) if extra is None or kl is not None else None
        if by_hand is not None:  # no graph (the default update's frozen events, the KL term beside them)
            own, _, descend = by_hand
            reported = float(torch.tensor(own).mean())
            t1 = descend()
            return StepTiming(t1 - t0, time.perf_counter() - t1, reported, 1, reported, own)
        # every event's rows through the learned layers in one batch (LearnedLayers.forward_many),
        # each attending to its own context: a full-context event its whole sequence, a frozen one
        # its target rows after its prompt's kept K/V
        hs, positions, contexts = [], [], []
        for p, _ in events:
            hs.append(p.h)
            if p.frozen:
                positions.append(torch.arange(p.prompt_len - 1, p.prompt_len - 1 + len(p.target)))
            else:
                positions.append(torch.arange(p.prompt_len + len(p.target)))
            contexts.append(p.context if p.frozen else None)
        outs = self.layers.forward_many(hs, positions, state.lora, contexts)
        losses = []
        for out, (p, s) in zip(outs, events):
            rows = out if p.frozen else out[p.prompt_len - 1:p.prompt_len - 1 + len(p.target)]
            logits, index = self._logits(rows, torch.tensor(p.target), p.negatives, p.exact)
            losses.append(feedback_loss(logits, index, s))
        own = [float(value.detach()) for value in losses]
        loss = torch.stack(losses).mean()
        reported = float(loss.detach())
        t1 = _descend(state, loss, extra, ahead, self.logits_ext)
        return StepTiming(t1 - t0, time.perf_counter() - t1, reported, 1, reported, own)

    def consolidate(self, state: TenantState, steps: int = 1) -> float:
        """EWC++'s pull toward theta*: the proximal step of the penalty lambda * sum F (theta - theta*)^2
        at the learning rate, theta <- theta* + (theta - theta*) / (1 + 2 lr lambda F), in closed form
        (the instant steps descend the feedback loss alone; this splits the penalty off them, as a
        proximal gradient method does), once for each of the `steps` instant steps it follows, so the
        pull does not depend on how many arrived between two passes. Returns the mean fraction of the
        distance from theta* kept."""
        if state.fisher is None or self.config.ewc_lambda <= 0:
            return 1.0
        c = self.config
        kept = []
        with torch.no_grad():
            for f, p, a in zip(state.fisher, state.lora.parameters(), state.anchor):
                factor = (1.0 + 2.0 * c.lr * c.ewc_lambda * f) ** -steps
                p.copy_(a + (p - a) * factor)
                kept.append(factor.mean())
        return float(torch.stack(kept).mean())

    def fisher_sample(self, lora: MicroLora, samples: list[Prepared]) -> list[torch.Tensor]:
        """Squared gradients of the LM loss on `samples` (prepared full-context prompt + output pairs)
        at `lora`'s weights, averaged: one draw of EWC++'s diagonal Fisher (fold it in with
        fold_fisher)."""
        params = lora.parameters()
        sq = [torch.zeros_like(p) for p in params]
        for prep in samples:
            # (samples come from prepare(..., context_mode="full"))
            out = self.layers.forward(prep.h, torch.arange(prep.prompt_len + len(prep.target)), lora)
            logits, index = self._logits(out[prep.prompt_len - 1:-1], torch.tensor(prep.target))
            grads = torch.autograd.grad(F.cross_entropy(logits, index), params, allow_unused=True)
            for s, g in zip(sq, grads):
                if g is not None:
                    s += g.detach() ** 2 / len(samples)
        return sq

    def fold_fisher(self, state: TenantState, sq: list[torch.Tensor]) -> None:
        """EWC++'s online Fisher: a new draw folded in with weight 1 - gamma."""
        gamma = self.config.fisher_gamma
        state.fisher = sq if state.fisher is None else [gamma * f + (1 - gamma) * s for f, s in zip(state.fisher, sq)]

    def _exact(self, labels: torch.Tensor, negatives: torch.Tensor | None) -> Exact:
        ids, inverse = torch.unique(labels if negatives is None else torch.cat([labels, negatives]),
                                    return_inverse=True)
        # (the drawn tokens are looked up in a vocabulary-wide table, ~35 us, where torch.isin sorts)
        hit = torch.zeros(self.layers.head.shape[0], dtype=torch.bool).index_fill_(0, ids, True)
        return Exact(ids, inverse[:len(labels)], hit, self.layers.head.index_select(0, ids))

    def _logits(self, rows: torch.Tensor, labels: torch.Tensor, negatives: torch.Tensor | None = None,
                exact: Exact | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Logits over the candidates and each label's index among them: the labels, the hard
        `negatives`, and `candidates` tokens drawn uniformly (with `estimate_rest`, each drawn one's
        logit raised by log(rest / drawn), so that together they weigh as the rest of the vocabulary;
        then the drawn ones are one pooled column, their log-sum-exp, after the exact ones).
        `exact`: the exact candidates of these labels and negatives found ahead (Prepared.exact)."""
        head = self.layers.head
        c = self.config
        n, vocab = c.candidates, head.shape[0]
        if not n or n >= vocab:
            return rows @ head.t(), labels
        drawn = self.candidates.take(n)  # made ahead by the background pass, or drawn now
        if not c.estimate_rest:
            fixed = labels if negatives is None else torch.cat([labels, negatives])
            cands, inverse = torch.unique(torch.cat([fixed, drawn.tokens]), return_inverse=True)
            return rows @ head.index_select(0, cands).t(), inverse[:len(labels)]
        if exact is None:
            exact = self._exact(labels, negatives)
        # A drawn token that is an exact one is not a candidate twice: it is masked out (no weight in
        # the softmax, a zero gradient), which is the softmax over the exact ones and the other drawn
        # ones, as when such tokens were dropped from the draw before gathering, while the drawn rows
        # stay the one block gathered ahead (candidates.py).
        clash = exact.hit.index_select(0, drawn.tokens)
        kept = n - int(clash.sum())
        # each drawn one's logit raised by log(rest / drawn): together they weigh as the rest. The
        # targets are all exact candidates, so the drawn ones enter the losses only through the
        # softmax's normalizer: one pooled column, their log-sum-exp (learning/sampled_logits.py)
        bias = math.log((vocab - len(exact.ids)) / max(kept, 1))
        return sampled_logits(rows, exact.rows, drawn.rows, bias, clash, self.logits_ext), exact.index


def _descend(state: TenantState, loss: torch.Tensor, extra: Callable[[MicroLora], torch.Tensor] | None,
             ahead: list[torch.Tensor] | None, ext: Any | None = None) -> float:
    """One Adam step of the tenant's micro-LoRA down `loss` (plus `extra`'s term, plus the `ahead`
    gradients): step's and step_events' shared end. Returns when the backward ended (perf_counter),
    where the optimizer's time begins. `ext`: adam_step's."""
    if extra is not None:
        loss = loss + extra(state.lora)
    state.opt.zero_grad()
    loss.backward()
    _add_grads(state.lora, ahead)
    t1 = time.perf_counter()
    adam_step(state.opt, ext)
    state.steps += 1
    return t1


def adam_step(opt: torch.optim.Optimizer, ext: Any | None = None) -> None:
    """`opt.step()` for the fused CPU Adam of `new_tenant`, as the one call of its kernel that
    `step()` ends in (torch.optim.adam's _fused_adam: every step count + 1, then _fused_adam_ over the
    parameters that have a gradient): the same kernel on the same tensors, so the same bits (tested).
    Why: at the micro-LoRA's two dozen small tensors the Optimizer.step wrapper around the kernel
    (hooks, the profiler's record, _init_group, grouping by device, the scalar conversions) is a third
    of its time: 385 against 264 us of CPU a step (one thread, load 3.2; docs/learning.md "Session
    20"). Any other optimizer or setting, or a parameter whose state is not yet made (its first
    step), takes `opt.step()`. With `ext` (cpu_build.kernels()), the same arithmetic as our one call
    over every tensor (learning/csrc/micro_lora.cpp micro_lora_adam_: torch's kernel enters a
    parallel region a tensor), the same bits (tested)."""
    groups = opt.param_groups
    g = groups[0]
    if type(opt) is not torch.optim.Adam or len(groups) != 1 or not g["fused"] or g["amsgrad"] or g["maximize"] \
            or g["capturable"] or g["differentiable"] or g["decoupled_weight_decay"] \
            or isinstance(g["lr"], torch.Tensor):
        opt.step()
        return
    params = [p for p in g["params"] if p.grad is not None]
    states = [opt.state.get(p) for p in params]
    if not params or not all(states) or any(p.grad.is_sparse or p.is_complex() or p.device.type != "cpu"
                                            for p in params):
        opt.step()
        return
    steps = [s["step"] for s in states]
    beta1, beta2 = g["betas"]
    if ext is not None and 1 - beta1 < 0.5:  # (the lerp form micro_lora_adam_ writes out)
        with torch.no_grad():
            ext.micro_lora_adam_(params, [p.grad.contiguous() for p in params], [s["exp_avg"] for s in states],
                                 [s["exp_avg_sq"] for s in states], steps, float(g["lr"]), float(beta1), float(beta2),
                                 float(g["eps"]), float(g["weight_decay"]))
        return
    with torch.no_grad():
        torch._foreach_add_(steps, 1)
        torch._fused_adam_(params, [p.grad for p in params], [s["exp_avg"] for s in states],
                           [s["exp_avg_sq"] for s in states], [], steps, amsgrad=False, lr=g["lr"], beta1=beta1,
                           beta2=beta2, weight_decay=g["weight_decay"], eps=g["eps"], maximize=False,
                           grad_scale=None, found_inf=None)


def _add_grads(lora: MicroLora, grads: list[torch.Tensor] | None) -> None:
    """Add a term's gradients (computed ahead, at these weights) to those the backward left."""
    if grads is None:
        return
    with torch.no_grad():
        for p, g in zip(lora.parameters(), grads):
            p.grad = g.clone() if p.grad is None else p.grad.add_(g)


def feedback_loss(logits: torch.Tensor, index: torch.Tensor, score: float) -> torch.Tensor:
    """An event's loss: cross-entropy toward the target weighted by the score (a correction, a
    positive score), or unlikelihood, -log(1 - p), away from it (`step` computes the first itself,
    keeping each token's loss to know when to stop)."""
    if score >= 0:
        return F.cross_entropy(logits, index) * max(score, 1e-3)
    p = logits.log_softmax(-1).gather(1, index[:, None]).exp().squeeze(1)
    return -torch.log1p(-p.clamp(max=1 - 1e-6)).mean() * -score
