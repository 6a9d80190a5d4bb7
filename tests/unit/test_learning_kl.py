"""The KL term toward the base on everyday text (learning/anchor.py; issue 37, item 2), on the tiny
model: zero at the base, exactly the coarsened KL (the base's top tokens and the rest) over the
whole vocabulary, estimated without bias worth the name from drawn candidates, and in the step it
keeps the everyday text's distributions nearer the base's than the same steps without it."""

from __future__ import annotations

import pytest
import torch

from ruvllm.learning.anchor import kl_mean, kl_to_base, make_anchor, shared_rows
from ruvllm.learning.config import InstantConfig
from ruvllm.learning.instant import InstantLearner
from ruvllm.learning.tail import LearnedLayers
from tests.engine_fixtures import write_tiny_model

PROMPT = [5, 80, 23, 311, 42, 17, 260, 9, 131, 77]
TARGET = [7, 8, 9, 10]
EVERYDAY = ([11, 12, 13, 14, 15], [40, 41, 42, 43, 44, 45])


@pytest.fixture(scope="module")
def layers(tmp_path_factory: pytest.TempPathFactory) -> LearnedLayers:
    from ruvllm.loader.source import resolve_model
    from ruvllm.quantize.awq_writer import load_float_model

    src = resolve_model(str(write_tiny_model(tmp_path_factory.mktemp("kl") / "base")))
    model, _, _ = load_float_model(src, 512)
    return LearnedLayers(model, 1)


def _moved(learner: InstantLearner, seed: int = 3):  # noqa: ANN202
    """A tenant whose micro-LoRA has left the base (B random)."""
    state = learner.new_tenant(seed)
    with torch.no_grad():
        for p in state.lora.parameters()[1::2]:
            p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(seed)) * 0.5)
    return state


def test_zero_at_the_base_and_exactly_the_coarsened_kl(layers: LearnedLayers) -> None:
    learner = InstantLearner(layers, InstantConfig(layers=1, candidates=0))
    prep = learner.prepare(*EVERYDAY, "full")
    anchor = make_anchor(layers, prep, 8)
    gen = torch.Generator().manual_seed(0)
    base = learner.new_tenant(1)
    assert abs(float(kl_to_base(layers, base.lora, anchor, 0, gen).detach())) < 1e-6
    state = _moved(learner)
    with torch.no_grad():
        n = len(EVERYDAY[0]) + len(EVERYDAY[1])
        p = (layers.forward(prep.h, torch.arange(n), None)[:-1] @ layers.head.t()).softmax(-1)
        q = (layers.forward(prep.h, torch.arange(n), state.lora)[:-1] @ layers.head.t()).softmax(-1)
        top = p.topk(8, dim=1).indices
        pk, qk = p.gather(1, top), q.gather(1, top)
        pr, qr = 1 - pk.sum(1), 1 - qk.sum(1)
        expected = ((pk * (pk / qk).log()).sum(1) + pr * (pr / qr).log()).mean()
        got = kl_to_base(layers, state.lora, anchor, 0, gen).detach()
    assert float(expected) > 1e-3 and abs(float(got) - float(expected)) < 1e-4 * max(1.0, float(expected))


def test_drawn_candidates_estimate_it(layers: LearnedLayers) -> None:
    learner = InstantLearner(layers, InstantConfig(layers=1, candidates=0))
    anchor = make_anchor(layers, learner.prepare(*EVERYDAY, "full"), 8)
    state = _moved(learner)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        exact = float(kl_to_base(layers, state.lora, anchor, 0, gen).detach())
        drawn = sum(float(kl_to_base(layers, state.lora, anchor, 128, gen).detach()) for _ in range(20)) / 20
    assert abs(drawn - exact) < 0.15 * exact


def test_the_term_keeps_everyday_text_nearer_the_base(layers: LearnedLayers) -> None:
    learner = InstantLearner(layers, InstantConfig(layers=1, candidates=0, lr=5e-2))
    prep = learner.prepare(PROMPT, TARGET)
    anchor = make_anchor(layers, learner.prepare(*EVERYDAY, "full"), 8)
    gen = torch.Generator().manual_seed(0)
    kl = {}
    for weight in (0.0, 5.0):
        state = learner.new_tenant(1)
        extra = (lambda lora: weight * kl_to_base(layers, lora, anchor, 0, gen)) if weight else None
        for _ in range(8):
            timing = learner.step(state, prep, 1.0, extra)
        with torch.no_grad():
            kl[weight] = float(kl_to_base(layers, state.lora, anchor, 0, gen).detach())
        assert timing.loss < 2.0  # the target is learned either way
    assert kl[5.0] < 0.5 * kl[0.0]


def test_the_term_computed_ahead_gives_the_same_step(layers: LearnedLayers) -> None:
    """The KL term's gradients computed ahead at the step's starting weights (learner.py's `_ahead`,
    off the feedback's path) and added to the feedback's: the same step as with the term in it."""
    learner = InstantLearner(layers, InstantConfig(layers=1, candidates=0, lr=5e-2))
    prep = learner.prepare(PROMPT, TARGET)
    anchor = make_anchor(layers, learner.prepare(*EVERYDAY, "full"), 8)
    gen = torch.Generator().manual_seed(0)
    inline, ahead = _moved(learner), _moved(learner)
    for _ in range(3):
        learner.step(inline, prep, 1.0, lambda lora: 2.0 * kl_to_base(layers, lora, anchor, 0, gen))
        copy = ahead.lora.copy()
        grads = torch.autograd.grad(2.0 * kl_to_base(layers, copy, anchor, 0, gen), copy.parameters())
        learner.step(ahead, prep, 1.0, None, list(grads))
    for a, b in zip(inline.lora.parameters(), ahead.lora.parameters()):
        assert (a - b).abs().max() < 1e-6 * max(1.0, float(a.detach().abs().max()))
    assert any(float(b.detach().abs().max()) > 1e-3 for b in ahead.lora.parameters()[1::2])  # it did learn


def test_the_mean_over_completions_batched_is_the_mean_one_by_one(layers: LearnedLayers) -> None:
    """kl_mean runs the completions' rows through the learned layers in one batch, the rows they
    begin with alike (a system prompt) once: the same term and gradient as one by one."""
    learner = InstantLearner(layers, InstantConfig(layers=1, candidates=0))
    state = _moved(learner)
    gen = torch.Generator().manual_seed(0)
    for others in (([3, 4, 5], [60, 61, 62, 63, 64, 65, 66]), ([11, 12, 13, 99], [60, 61, 62]), EVERYDAY):
        anchors = [make_anchor(layers, learner.prepare(p, o, "full"), 8) for p, o in (EVERYDAY, others)]
        shared = shared_rows([a.prep.h for a in anchors])
        assert shared == {5: 0, 99: 3, 15: 10}[others[0][-1]]  # none; three; all but the last row
        one_by_one = sum(kl_to_base(layers, state.lora, a, 0, gen) for a in anchors) / 2
        batched = kl_mean(layers, state.lora, anchors, 0, gen)
        together, apart = batched.item(), one_by_one.item()
        assert apart > 1e-3 and abs(together - apart) < 1e-5 * apart
        g1 = torch.autograd.grad(one_by_one, state.lora.parameters())
        g2 = torch.autograd.grad(batched, state.lora.parameters())
        for a, b in zip(g1, g2):
            assert (a - b).norm() <= 1e-4 * a.norm()
