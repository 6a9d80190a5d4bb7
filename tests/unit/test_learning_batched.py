"""Several feedback events in one step (issue 37 item 3), on the tiny model: events of different
lengths, batched through the learned layers (each attending to its own rows and, frozen, its own
prompt's K/V), give the gradient of the mean of their losses computed one by one, whatever the mix
of context forms."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ruvllm.learning.config import InstantConfig
from ruvllm.learning.instant import InstantLearner, feedback_loss
from ruvllm.learning.tail import LearnedLayers
from tests.engine_fixtures import write_tiny_model
from tests.lora_fixtures import nonzero_b

EVENTS = [([5, 80, 23, 311, 42, 17, 260, 9, 131, 77], [7, 8, 9, 10], 1.0),
          ([12, 99, 4], [30, 31], -0.5),
          ([6, 61, 201, 13, 8, 250], [44, 45, 46], 0.7)]


@pytest.fixture(scope="module")
def layers(tmp_path_factory: pytest.TempPathFactory) -> LearnedLayers:
    from ruvllm.loader.source import resolve_model
    from ruvllm.quantize.awq_writer import load_float_model

    src = resolve_model(str(write_tiny_model(tmp_path_factory.mktemp("batched") / "base")))
    model, _, _ = load_float_model(src, 512)
    return LearnedLayers(model, 2)


def _one_by_one(learner: InstantLearner, state, preps) -> list[torch.Tensor]:  # noqa: ANN001
    losses = []
    for prep, (_, target, score) in zip(preps, EVENTS):
        logits, index = learner._logits(learner._rows(prep, state.lora), torch.tensor(target))
        losses.append(feedback_loss(logits, index, score))
    return list(torch.autograd.grad(torch.stack(losses).mean(), state.lora.parameters()))


@pytest.mark.parametrize("context", ["full", "frozen"])
def test_a_batched_step_is_the_mean_of_the_events_losses(layers: LearnedLayers, context: str) -> None:
    learner = InstantLearner(layers, InstantConfig(layers=2, candidates=0, context=context))
    state = learner.new_tenant(seed=5)
    nonzero_b(state.lora, 0.1)
    preps = [learner.prepare(prompt, target) for prompt, target, _ in EVENTS]
    expected = _one_by_one(learner, state, preps)
    before = [p.detach().clone() for p in state.lora.parameters()]
    timing = learner.step_events(state, [(p, s) for p, (_, _, s) in zip(preps, EVENTS)])
    assert timing.steps == 1 and state.steps == 1
    for p, g, b in zip(state.lora.parameters(), expected, before):
        assert p.grad is not None and g.norm() > 0
        assert (p.grad - g).norm() <= 1e-4 * g.norm()
        assert not torch.equal(p.detach(), b)  # the one Adam step was taken


def test_one_event_batched_is_the_events_own_loss(layers: LearnedLayers) -> None:
    learner = InstantLearner(layers, InstantConfig(layers=2, candidates=0))
    state = learner.new_tenant(seed=6)
    prompt, target, _ = EVENTS[0]
    prep = learner.prepare(prompt, target)
    with torch.no_grad():
        expected = float(F.cross_entropy(learner._rows(prep, state.lora) @ layers.head.t(), torch.tensor(target)))
    assert learner.step_events(state, [(prep, 1.0)]).loss == pytest.approx(expected, rel=1e-5)


def test_full_and_frozen_events_batched_together(layers: LearnedLayers) -> None:
    """One batch holding both forms (a learner whose context changed between two events)."""
    learners = {c: InstantLearner(layers, InstantConfig(layers=2, candidates=0, context=c)) for c in ("full", "frozen")}
    learner = learners["full"]
    state = learner.new_tenant(seed=7)
    nonzero_b(state.lora, 0.1, seed=1)
    preps = [learners[c].prepare(prompt, target) for c, (prompt, target, _) in zip(("frozen", "full", "frozen"), EVENTS)]
    expected = _one_by_one(learner, state, preps)
    learner.step_events(state, [(p, s) for p, (_, _, s) in zip(preps, EVENTS)])
    for p, g in zip(state.lora.parameters(), expected):
        assert (p.grad - g).norm() <= 1e-4 * g.norm()
