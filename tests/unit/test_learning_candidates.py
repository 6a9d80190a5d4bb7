"""The instant step's sampled softmax and its steps per event (issue 37), on the tiny model: the
base model's top tokens are always candidates, the drawn ones stand for the rest of the vocabulary
(the loss estimates the full softmax's, where drawing alone bounds it from below), and an event
takes steps until its worst target token's loss is under the bound, or the most it may."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ruvllm.learning.config import InstantConfig
from ruvllm.learning.instant import InstantLearner
from ruvllm.learning.tail import LearnedLayers
from tests.engine_fixtures import write_tiny_model

PROMPT = [5, 80, 23, 311, 42, 17, 260, 9, 131, 77]
TARGET = [7, 8, 9, 10]


@pytest.fixture(scope="module")
def layers(tmp_path_factory: pytest.TempPathFactory) -> LearnedLayers:
    from ruvllm.loader.source import resolve_model
    from ruvllm.quantize.awq_writer import load_float_model

    src = resolve_model(str(write_tiny_model(tmp_path_factory.mktemp("cands") / "base")))
    model, _, _ = load_float_model(src, 512)
    return LearnedLayers(model, 1)


def _full_nll(learner: InstantLearner, prep) -> torch.Tensor:  # noqa: ANN001
    with torch.no_grad():
        rows = learner._rows(prep, None)
        return F.cross_entropy(rows @ learner.layers.head.t(), torch.tensor(TARGET), reduction="none")


def _sampled_nll(learner: InstantLearner, prep, draws: int) -> float:  # noqa: ANN001
    with torch.no_grad():
        rows = learner._rows(prep, None)
        total = 0.0
        for _ in range(draws):
            logits, index = learner._logits(rows, torch.tensor(TARGET), prep.negatives)
            total += float(F.cross_entropy(logits, index))
        return total / draws


def test_hard_negatives_are_the_base_models_top_tokens(layers: LearnedLayers) -> None:
    learner = InstantLearner(layers, InstantConfig(layers=1, candidates=32, hard_negatives=4, estimate_rest=True))
    prep = learner.prepare(PROMPT, TARGET)
    with torch.no_grad():
        logits = learner._rows(prep, None) @ layers.head.t()
    logits[torch.arange(len(TARGET)), torch.tensor(TARGET)] = float("-inf")  # a label is never its own negative
    assert set(prep.negatives.tolist()) == set(logits.topk(4, dim=1).indices.flatten().tolist())
    assert InstantLearner(layers, InstantConfig(layers=1, candidates=0, hard_negatives=4)).prepare(
        PROMPT, TARGET).negatives is None  # the whole vocabulary: nothing to add


def test_the_drawn_candidates_estimate_the_full_softmax(layers: LearnedLayers) -> None:
    """Drawn alone, 32 of 512 tokens make the loss far smaller than the full softmax's; with the
    base's top tokens kept and the drawn ones weighed as the rest, its mean over draws is close."""
    full = float(_full_nll(InstantLearner(layers, InstantConfig(layers=1)), InstantLearner(
        layers, InstantConfig(layers=1, candidates=0)).prepare(PROMPT, TARGET)).mean())
    plain = InstantLearner(layers, InstantConfig(layers=1, candidates=32, hard_negatives=0, estimate_rest=False))
    plain_loss = _sampled_nll(plain, plain.prepare(PROMPT, TARGET), 200)
    fixed = InstantLearner(layers, InstantConfig(layers=1, candidates=32, hard_negatives=8, estimate_rest=True))
    fixed_loss = _sampled_nll(fixed, fixed.prepare(PROMPT, TARGET), 200)
    assert plain_loss < 0.7 * full
    assert abs(fixed_loss - full) < 0.1 * full


def test_an_event_steps_until_its_worst_token_is_learned(layers: LearnedLayers) -> None:
    cfg = InstantConfig(layers=1, candidates=0, lr=5e-2, steps_per_event=8, target_nll=0.5)
    learner = InstantLearner(layers, cfg)
    prep = learner.prepare(PROMPT, TARGET)
    state = learner.new_tenant(seed=0)
    timing = learner.step(state, prep, 1.0)
    worst = float(_full_nll(learner, prep).max())  # the base's, for the record: the step changed the lora only
    assert timing.steps > 1 and state.steps == timing.steps and timing.final_loss < timing.loss
    with torch.no_grad():
        rows = learner._rows(prep, state.lora)
        after = F.cross_entropy(rows @ layers.head.t(), torch.tensor(TARGET), reduction="none")
    assert timing.steps == 8 or float(after.max()) < 0.5
    assert worst > 0.5  # the bound was not met before the event
    one = InstantLearner(layers, InstantConfig(layers=1, candidates=0, lr=5e-2))  # the default: one step an event
    assert one.step(one.new_tenant(seed=0), one.prepare(PROMPT, TARGET), 1.0).steps == 1
