"""Several sequences in one pass of the learned layers' C++ calls (issue 37 item 3, session 21:
learned_layers.cpp's `sizes` and `after`, whole_layers.WholePass, LearnedLayers.whole_pass_many):
a backlog's frozen-context events each against its own kept K/V, and the KL term's completions after
their shared start (which they attend to and learn through), with no autograd graph, against the
autograd graph's path they replace (LearnedLayers.forward_many, anchor.kl_mean, step_events with
the graph), which stays the reference, on the default model's packed weights.

Each sequence's rows are bitwise a pass of it alone (every op but attention is row by row, and
attention runs a sequence at a time), and bitwise forward_many's (the same kernels in the same order:
its attention our C++ node too). The gradients are the graph's sums in another order: the
micro-LoRA's within 1% of their norm (measured at most 0.07%, the shared start's K/V gradient
gathered from its continuations in another order, which can move a value of dY across the 8-bit
backward's rounding step; the frozen events' and the KL term's 0.00%), and a coalesced step's within
5%, test_learning_whole.py's rule for the graphless step (measured 1.01% at one thread). (With causal_attention's
torch ops in forward_many, as before session 21, the rows were 0.3-0.6% apart through the forward's
8-bit rounding of the activations, and the KL term's small gradient up to 29%: a reference that
does not share the forward's rounding cannot check a term near zero.)"""

from __future__ import annotations

import pytest
import torch

from ruvllm.cpu_build import kernels
from ruvllm.learning.anchor import KlTerm, kl_grads, kl_mean, make_anchor, shared_rows
from ruvllm.learning.config import InstantConfig
from ruvllm.learning.instant import InstantLearner
from ruvllm.learning.tail import LearnedLayers, hidden_before
from tests.lora_fixtures import nonzero_b

pytestmark = pytest.mark.skipif(kernels() is None, reason="our C++ kernels do not build here")

PROMPT = [1, 9690, 198, 2683, 314, 260, 3575, 282, 34106, 47, 2, 198]
TARGET = [504, 3575, 282, 34106, 314, 2]
OTHER = (PROMPT[:-3] + [1502, 2, 198], [4273, 25, 2])
# two everyday completions that begin alike (as a chat template's system prompt makes them)
EVERYDAY = ((PROMPT[:8] + [7360, 47, 2, 198], [2683, 314, 260, 3575, 2]),
            (PROMPT[:8] + [1128, 281, 47, 2, 198], [504, 4273, 282, 2]))


@pytest.fixture(scope="module")
def layers():  # noqa: ANN201
    from ruvllm.learning.tail import load_learning_model
    from ruvllm.loader.source import resolve_model

    return LearnedLayers(load_learning_model(resolve_model(None))[0], InstantConfig().layers)


def _lora(layers: LearnedLayers, seed: int = 3):  # noqa: ANN202
    lora = InstantLearner(layers, InstantConfig()).new_tenant(seed=seed).lora
    nonzero_b(lora, 0.05)
    return lora


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def _against_graph(layers: LearnedLayers, hs, positions, contexts, after, shared: bool):  # noqa: ANN001, ANN202
    """(the pass's rows, forward_many's rows, each gradient's distance from the graph's) for a random
    weighting of the rows."""
    lora = _lora(layers)
    weights = [torch.randn(len(h), layers.cfg.hidden_size, generator=torch.Generator().manual_seed(i))
               for i, h in enumerate(hs)]
    outs = layers.forward_many(hs, positions, lora, contexts, shared_prefix=shared)
    graph = torch.autograd.grad(sum((o * w).sum() for o, w in zip(outs, weights)), lora.parameters())
    run = layers.whole_pass_many(hs, positions, lora, contexts, after)
    assert run is not None and run.sizes == [len(h) for h in hs]
    rows = run.rows.clone()
    by = {id(p): g for p, g in run.backward(torch.cat(weights))}
    assert len(by) == len(lora.parameters())
    dist = []
    for p, g in zip(lora.parameters(), graph):
        assert g.norm() > 0
        dist.append(_rel(by[id(p)], g))
    return rows, torch.cat([o.detach() for o in outs]), dist, lora


def test_frozen_events_in_one_pass(layers: LearnedLayers) -> None:
    """A backlog's frozen-context events, each against its own prompt's kept K/V: each event's rows
    bitwise its pass alone, and the rows and gradients forward_many's (the graph) within tolerance."""
    learner = InstantLearner(layers, InstantConfig())
    preps = [learner.prepare(PROMPT, TARGET), learner.prepare(*OTHER)]
    hs = [p.h for p in preps]
    positions = [torch.arange(p.prompt_len - 1, p.prompt_len - 1 + len(p.target)) for p in preps]
    rows, graph_rows, dist, lora = _against_graph(layers, hs, positions, [p.context for p in preps], None, False)
    at = 0
    for h, pos, p in zip(hs, positions, preps):
        assert torch.equal(rows[at:at + len(h)], layers.whole_pass(h, pos, lora, p.context).rows)
        at += len(h)
    print(f"frozen events: gradients at most {max(dist):.3%} apart")
    assert torch.equal(rows, graph_rows)
    assert max(dist) <= 1e-2


def test_sequences_after_a_shared_start_learn_through_it(layers: LearnedLayers) -> None:
    """The KL term's form: a shared start, then two sequences continuing it (attending to its K/V of
    this pass, their gradient flowing into its rows): the start's rows bitwise its pass alone, a
    continuation's rows bitwise the whole sequence's pass alone, the gradients forward_many's
    (shared_prefix) within tolerance."""
    a, b = (p + t for p, t in EVERYDAY)
    ha, hb = hidden_before(layers.model, a, layers.first), hidden_before(layers.model, b, layers.first)
    s = 8
    hs = [ha[:s], ha[s:], hb[s:]]
    positions = [torch.arange(s), torch.arange(s, len(a)), torch.arange(s, len(b))]
    rows, graph_rows, dist, lora = _against_graph(layers, hs, positions, [None] * 3, [-1, 0, 0], True)
    assert torch.equal(rows[:s], layers.whole_pass(ha[:s], positions[0], lora).rows)
    alone = layers.whole_pass(hb, torch.arange(len(b)), lora).rows
    assert torch.equal(rows[len(a):], alone[s:])
    print(f"after a shared start: gradients at most {max(dist):.3%} apart")
    assert torch.equal(rows, graph_rows)
    assert max(dist) <= 1e-2


def test_the_call_refuses_a_layout_it_cannot_run(layers: LearnedLayers) -> None:
    h = hidden_before(layers.model, PROMPT, layers.first)
    pos = [torch.arange(4), torch.arange(4, len(PROMPT))]
    with pytest.raises(RuntimeError, match="after"):  # continuing a later sequence
        layers.whole_pass_many([h[:4], h[4:]], pos, None, [None, None], [1, -1])
    with pytest.raises(RuntimeError, match="context"):  # a continued sequence with a context of its own
        kv = [(torch.zeros(2, layers.cfg.num_kv_heads, layers.cfg.head_dim),) * 2 for _ in layers.layers]
        layers.whole_pass_many([h[:4], h[4:]], pos, None, [kv, None], [-1, 0])


def _term(layers: LearnedLayers, learner: InstantLearner, seed: int) -> KlTerm:
    anchors = [make_anchor(layers, learner.prepare(p, t, "full"), 32) for p, t in EVERYDAY]
    return KlTerm(layers, anchors, 2.0, 2048, torch.Generator().manual_seed(seed), kl_mean)


def test_the_kl_term_without_the_graph_is_kl_mean(layers: LearnedLayers) -> None:
    """kl_grads (the background pass's term computed ahead, Learner._ahead): the completions in one
    pass after their shared start, the KL over their rows differentiated from the rows alone: its
    value and gradients those of autograd through kl_mean, the same 2,048 drawn candidates (the same
    generator's draws), within tolerance."""
    learner = InstantLearner(layers, InstantConfig())
    lora = _lora(layers, 5)
    term = _term(layers, learner, 7)
    value, grads = kl_grads(layers, lora, term)
    reference = 2.0 * kl_mean(layers, lora, term.anchors, 2048, torch.Generator().manual_seed(7))
    graph = torch.autograd.grad(reference, lora.parameters())
    assert shared_rows([a.prep.h for a in term.anchors]) > 0  # (the two begin alike: the shared start's path)
    assert value == pytest.approx(float(reference.detach()), rel=1e-5)
    dist = [_rel(g, r) for g, r in zip(grads, graph)]
    print(f"KL term: {value:.5f} against {float(reference.detach()):.5f}, gradients at most {max(dist):.3%} apart")
    assert all(r.norm() > 0 for r in graph) and max(dist) <= 1e-2


def test_a_coalesced_step_with_the_kl_term_without_the_graph(layers: LearnedLayers) -> None:
    """step_events over two events with the KL term (a backlog: the term computed in the step), no
    graph (the events' rows and the completions in one pass), against the graph's step (graphless
    off): each event's loss within float rounding, the gradients Adam was given within tolerance."""
    from ruvllm.learning import instant as instant_module

    runs = []
    for graphless in (True, False):
        learner = InstantLearner(layers, InstantConfig())
        learner.graphless = learner.graphless_kl = graphless
        events = [(learner.prepare(PROMPT, TARGET), 1.0), (learner.prepare(*OTHER), -1.0)]
        state = learner.new_tenant(seed=8)
        nonzero_b(state.lora, 0.05)
        grads, made, kept = [], [], instant_module.adam_step
        by_hand = InstantLearner._many_by_hand

        def record(opt, ext=None) -> None:  # noqa: ANN001
            grads.extend(p.grad.clone() for group in opt.param_groups for p in group["params"])
            kept(opt, ext)

        instant_module.adam_step = record
        learner._many_by_hand = lambda *a: made.append(by_hand(learner, *a)) or made[-1]
        try:
            timing = learner.step_events(state, events, _term(layers, learner, 9))
        finally:
            instant_module.adam_step = kept
        assert [m is not None for m in made] == ([True] if graphless else [])  # (the graph's: not called)
        runs.append((timing.losses, grads))
    (losses_h, grads_h), (losses_g, grads_g) = runs
    assert losses_h == pytest.approx(losses_g, rel=1e-5)
    dist = [_rel(a, b) for a, b in zip(grads_h, grads_g)]
    print(f"coalesced step with the KL term: gradients at most {max(dist):.3%} apart")
    # Within 5% of their norm, test_learning_whole.py's rule for the graphless step: the graph's sums
    # of the events' and the term's gradients are torch's, whose order follows the thread count, and
    # a float-rounding difference can move a value of dY across the 8-bit backward's rounding step
    # (measured 0.00% at two threads, 1.01% at one, as the suite runs it: session 21's fresh clone).
    assert len(dist) == len(grads_g) > 0 and max(dist) <= 5e-2
