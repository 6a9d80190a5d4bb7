"""The learner's memory is bounded whatever the number of tenants that learn (issue 33: RSS grew
~1.9 MB a learning tenant): at most `states_keep` tenants' learning states, `prepared_keep`
prepared pairs and the pattern bank's most recent indexes are held; an evicted tenant learns on
from its serving version, rebuilt. On the tiny model."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ruvllm import LLM, SamplingParams
from ruvllm.learning.config import InstantConfig, LearningConfig
from tests.engine_fixtures import write_tiny_model

GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("bounds") / "base")


def _llm(base: Path, root: Path, **learning: object) -> LLM:
    llm = LLM(str(base), enable_lora=True, max_loras=2, max_cpu_loras=3, max_lora_rank=4, num_blocks=64,
              quantization="none")
    cfg = InstantConfig(layers=1, lr=5e-2, context="full", candidates=0, ewc_lambda=1e6, fisher_every=1)
    llm.enable_learning(LearningConfig(instant=cfg, root=str(root), **learning))
    llm.learner.bank.max_indexes = 2
    return llm


def test_kept_learning_state_never_exceeds_its_bounds(base: Path, tmp_path: Path) -> None:
    llm = _llm(base, tmp_path / "learned", states_keep=2, prepared_keep=3)
    learner = llm.learner
    for i in range(8):
        t = f"t{i}"
        llm.generate([[11 + i, 12, 13, 14]], GREEDY, tenant=t)  # everyday text: its Fisher's
        asked = llm.generate([[5, 80 + i, 23, 311, 42]], GREEDY, tenant=t)[0]
        for _ in range(2):
            llm.feedback(asked.request_id, 1.0, "t7 t7", tenant=t)
            assert len(learner._tenants) <= 2 and len(learner._prepared) <= 3 and len(learner.bank._indexes) <= 2
        learner.consolidate()
        assert len(learner._tenants) <= 2 and len(learner._prepared) <= 3
    assert list(learner._tenants) == ["t6", "t7"]  # the most recently taught
    assert learner.bank.count("t0") == 2 and len(learner.bank.best_per_cluster("t0")) == 1


def test_an_evicted_tenant_learns_on_from_its_serving_version(base: Path, tmp_path: Path) -> None:
    """Its state is rebuilt from the version that serves it: the same weights and step count; what it
    is served does not change by the eviction."""
    llm = _llm(base, tmp_path / "learned", states_keep=1)
    learner = llm.learner
    asked = llm.generate([[5, 80, 23, 311, 42]], GREEDY, tenant="acme")[0]
    for _ in range(3):
        llm.feedback(asked.request_id, 1.0, "t7 t7", tenant="acme")
    learner.consolidate()  # (nothing to pull toward: no everyday text) its updates are no longer pending
    weights = [p.detach().clone() for p in learner._tenants["acme"].lora.parameters()]
    served = llm.generate([[5, 80, 23, 311, 42]], GREEDY, tenant="acme")[0].outputs[0].token_ids
    other = llm.generate([[5, 81, 23]], GREEDY, tenant="globex")[0]
    llm.feedback(other.request_id, 1.0, "t9", tenant="globex")
    assert list(learner._tenants) == ["globex"]
    with learner._lock:
        state = learner._state("acme")
    assert state.steps == 3 and state.fisher is None
    assert all(torch.equal(p, w) for p, w in zip(state.lora.parameters(), weights))
    assert llm.generate([[5, 80, 23, 311, 42]], GREEDY, tenant="acme")[0].outputs[0].token_ids == served
    assert llm.feedback(asked.request_id, 1.0, "t7 t7", tenant="acme").version == "learned:acme:v4"


def test_tenants_with_updates_pending_are_evicted_last(base: Path, tmp_path: Path) -> None:
    """Their consolidation (the pull for each of their steps) goes with their state; offline, where
    nothing consolidates unless asked, every tenant waits and the bound still holds."""
    llm = _llm(base, tmp_path / "learned", states_keep=2)
    learner = llm.learner
    asked = {t: llm.generate([[5, 80, 23, 311, 42]], GREEDY, tenant=t)[0] for t in ("acme", "globex", "initech")}
    llm.feedback(asked["acme"].request_id, 1.0, "t7 t7", tenant="acme")
    learner.consolidate()  # acme waits for nothing now
    llm.feedback(asked["globex"].request_id, 1.0, "t7 t7", tenant="globex")  # globex waits for a pass
    with learner._lock:
        learner._state("acme")  # acme used more recently than globex
    llm.feedback(asked["initech"].request_id, 1.0, "t7", tenant="initech")
    assert list(learner._tenants) == ["globex", "initech"]  # acme went, though globex was used less recently
    for i in range(5):  # nothing consolidated: all wait, the bound holds
        t = f"t{i}"
        llm.feedback(llm.generate([[5, 90 + i, 23]], GREEDY, tenant=t)[0].request_id, 1.0, "t7", tenant=t)
        assert len(learner._tenants) <= 2 and len(learner._pending) <= 2


def test_the_kl_term_anchors_on_everyday_text_only(base: Path, tmp_path: Path) -> None:
    """With `kl_weight`, the step's KL term is over the tenant's own everyday completions: never the
    one it corrected, nor another tenant's."""
    llm = LLM(str(base), enable_lora=True, max_loras=2, max_lora_rank=4, num_blocks=64, quantization="none")
    cfg = InstantConfig(layers=1, lr=5e-2, candidates=0, kl_weight=1.0, kl_samples=4)
    learner = llm.enable_learning(LearningConfig(instant=cfg, root=str(tmp_path / "learned")))
    llm.generate([[9, 8, 7, 6]], GREEDY, tenant="globex")
    everyday = llm.generate([[11, 12, 13, 14]], GREEDY, tenant="acme")[0]
    asked = llm.generate([[5, 80, 23, 311, 42]], GREEDY, tenant="acme")[0]
    llm.feedback(asked.request_id, 1.0, "t7 t7", tenant="acme")
    assert list(learner._anchors) == [(tuple(everyday.prompt_token_ids), tuple(everyday.outputs[0].token_ids))]


def test_the_kl_term_is_computed_ahead_for_the_next_step(base: Path, tmp_path: Path) -> None:
    """After an update the background pass computes the KL term's gradients at the weights it left
    (issue 37 item 1: off the feedback's path); the next event's step adds them instead of running
    the term, and lands where the step with the term in it lands. Changed weights are never fitted."""
    import copy

    from ruvllm.learning.anchor import kl_to_base
    from ruvllm.learning.instant import TenantState

    llm = LLM(str(base), enable_lora=True, max_loras=2, max_cpu_loras=4, max_lora_rank=4, num_blocks=64,
              quantization="none")
    cfg = InstantConfig(layers=1, lr=5e-2, candidates=0, kl_weight=1.0, kl_samples=2, ewc_lambda=1e6)
    learner = llm.enable_learning(LearningConfig(instant=cfg, root=str(tmp_path / "learned")))
    llm.generate([[11, 12, 13, 14], [21, 22, 23]], GREEDY, tenant="acme")
    asked = llm.generate([[5, 80, 23, 311, 42]], GREEDY, tenant="acme")[0]
    llm.feedback(asked.request_id, 1.0, "t7 t7", tenant="acme")  # the first: the term in the step
    assert "acme" in learner.consolidate()  # pulled, published, and the term computed for the next step
    state = learner._tenants["acme"]
    anchors = tuple(learner._anchors_of("acme"))
    assert state.ahead is not None and state.ahead.fits(state.lora, anchors) and len(anchors) == 2

    # by hand: the same state, the term in the step
    lora = state.lora.copy()
    opt = torch.optim.Adam(lora.parameters(), lr=cfg.lr, fused=True)
    opt.load_state_dict(copy.deepcopy(state.opt.state_dict()))
    by_hand = TenantState(lora, opt, state.anchor)
    target = llm.tokenizer.encode("t7 t7", add_special_tokens=False) + [learner.eos]
    prep = learner.instant.prepare(list(asked.prompt_token_ids), target)
    learner.instant.step(by_hand, prep, 1.0, lambda w: cfg.kl_weight * sum(
        kl_to_base(learner.layers, w, a, 0, torch.Generator()) for a in anchors) / len(anchors))

    llm.feedback(asked.request_id, 1.0, "t7 t7", tenant="acme")
    assert state.ahead is None  # taken by the step
    for a, b in zip(state.lora.parameters(), by_hand.lora.parameters()):
        assert (a - b).abs().max() < 1e-5 * max(1.0, float(b.detach().abs().max()))
    learner.consolidate()
    with torch.no_grad():
        state.lora.parameters()[1].add_(1e-3)  # weights changed after the term was computed
    assert state.ahead is not None and not state.ahead.fits(state.lora, anchors)
    # a step of the scope already coming (a backlog): the pass leaves the term to it, not computed twice
    state.ahead = None
    learner._stepping["acme"] = 1
    llm.feedback(asked.request_id, 1.0, "t7 t7", tenant="acme")
    learner.consolidate()
    assert state.ahead is None
    del learner._stepping["acme"]


def test_the_background_pass_draws_the_next_steps_candidates(base: Path, tmp_path: Path) -> None:
    """The sampled softmax's drawn candidates are made ahead (learning/candidates.py): ready when the
    learner starts, one batch taken by each step, made again by the background pass, and the steps
    take the generator's draws in order, as when each drew its own."""
    llm = LLM(str(base), enable_lora=True, max_loras=2, max_cpu_loras=3, max_lora_rank=4, num_blocks=64,
              quantization="none")
    cfg = InstantConfig(layers=1, lr=5e-2, candidates=32, hard_negatives=4, candidates_ahead=2, seed=7)
    learner = llm.enable_learning(LearningConfig(instant=cfg, root=str(tmp_path / "learned")))
    pool = learner.instant.candidates
    assert pool.ready() == 2
    asked = llm.generate([[5, 80, 23, 311, 42]], GREEDY, tenant="acme")[0]
    llm.feedback(asked.request_id, 1.0, "t7 t7", tenant="acme")
    assert pool.ready() == 1  # the step took the first
    learner.consolidate()
    assert pool.ready() == 2
    llm.feedback(asked.request_id, 1.0, "t7 t7", tenant="acme")
    learner.consolidate()
    gen = torch.Generator().manual_seed(7)
    draws = [torch.randint(0, learner.layers.head.shape[0], (32,), generator=gen) for _ in range(3)]
    assert torch.equal(pool.take(32).tokens, draws[2])  # the two steps took the first two, in order
