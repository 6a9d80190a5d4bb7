"""Session 17's cuts to the instant step (issue 37 item 1): a packed projection with its micro-LoRA
pieces as one autograd node (packed_linear.PackedLoraMatmul) computes what the packed matmul and the
deltas as separate torch ops compute, forward and backward; and the sampled softmax's strided draw
gives each token the same chance as the uniform one, its drawn rows read in place, and the same
estimate of the full softmax's loss."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from ruvllm.cpu_build import kernels
from ruvllm.learning.config import InstantConfig
from ruvllm.learning.instant import InstantLearner
from ruvllm.learning.packed_linear import packed_linear, packed_lora_linear
from ruvllm.learning.tail import LearnedLayers
from ruvllm.quant import cpu_matmul
from ruvllm.quant.rtn import quantize_int4
from tests.engine_fixtures import write_tiny_model

needs_kernels = pytest.mark.skipif(kernels() is None, reason="our C++ kernels do not build here")


def _reference(x, packed, bias, scaling, pieces):  # noqa: ANN001, ANN202
    """The composition the fused node replaces: the packed matmul, then each delta padded and added."""
    y = packed_linear(x, packed, bias)
    for lo, hi, a, b in pieces:
        y = y + F.pad(((x @ a.t()) * scaling) @ b.t(), (lo, y.shape[-1] - hi))
    return y


@needs_kernels
@pytest.mark.parametrize("spans", [[(64, 96)], [(0, 32), (96, 128)]], ids=["one piece", "two pieces"])
@pytest.mark.parametrize("input_grad", [True, False])
def test_the_fused_projection_is_the_matmul_and_its_deltas(spans: list[tuple[int, int]], input_grad: bool) -> None:
    g = torch.Generator().manual_seed(7)
    packed = cpu_matmul.pack(quantize_int4(torch.randn(128, 96, generator=g), 32))
    bias = torch.randn(128, generator=g)
    x = torch.randn(11, 96, generator=g)
    pieces = [(lo, hi, torch.randn(2, 96, generator=g).requires_grad_(),
               (torch.randn(hi - lo, 2, generator=g) * 0.1).requires_grad_()) for lo, hi in spans]
    dy = torch.randn(11, 128, generator=g)
    results = []
    for fn in (packed_lora_linear, _reference):
        xi = x.clone().requires_grad_(input_grad)
        y = fn(xi, packed, bias, 2.0, pieces)
        params = [t for _, _, a, b in pieces for t in (a, b)]
        grads = torch.autograd.grad(y, ([xi] if input_grad else []) + params, dy)
        results.append((y.detach(), grads))
    (y_f, g_f), (y_r, g_r) = results
    assert (y_f - y_r).abs().max() <= 1e-5 * y_r.abs().max()
    assert len(g_f) == len(g_r)
    for a, b in zip(g_f, g_r):
        assert b.norm() > 0
        assert (a - b).abs().max() <= 1e-5 * b.abs().max()


@pytest.fixture(scope="module")
def layers(tmp_path_factory: pytest.TempPathFactory) -> LearnedLayers:
    from ruvllm.loader.source import resolve_model
    from ruvllm.quantize.awq_writer import load_float_model

    src = resolve_model(str(write_tiny_model(tmp_path_factory.mktemp("draw") / "base")))
    return LearnedLayers(load_float_model(src, 512)[0], 1)


@pytest.mark.parametrize("candidates", [32, 100])  # 512 / 100 leaves 12 tokens past the last stride
def test_the_strided_draw_gives_every_token_the_same_chance(layers: LearnedLayers, candidates: int) -> None:
    """Over many draws each token of the vocabulary is drawn candidates / vocab of the time (a start
    uniform over the vocabulary, the stride wrapping), the labels and hard negatives never twice."""
    learner = InstantLearner(layers, InstantConfig(layers=1, candidates=candidates, draw="strided"))
    vocab, hidden = layers.head.shape
    exact = torch.tensor([3, 200, 201])
    # rows that pick out each candidate's place: the logits of unit rows are the head's columns, so
    # give each head row its own token id in column 0 and read the drawn ids back from the logits
    head = torch.zeros(vocab, hidden)
    head[:, 0] = torch.arange(vocab, dtype=torch.float32)
    learner.layers = type("Head", (), {"head": head})()
    row = torch.zeros(1, hidden)
    row[0, 0] = 1.0
    counts = torch.zeros(vocab)
    draws = 2000
    for _ in range(draws):
        logits, index = learner._strided_logits(row, exact, torch.tensor([0]))
        assert logits.shape == (1, len(exact) + candidates) and int(index) == 0
        assert torch.equal(logits[0, :len(exact)], exact.float())
        drawn = logits[0, len(exact):]
        kept = drawn[torch.isfinite(drawn)]
        # each kept one's logit is its id plus the weight log(rest / kept), the same for all
        ids = torch.round(kept - math.log((vocab - len(exact)) / len(kept))).long()
        assert not torch.isin(ids, exact).any() and len(ids.unique()) == len(ids)
        counts[ids] += 1
    expected = draws * candidates / vocab
    rest = torch.ones(vocab, dtype=torch.bool)
    rest[exact] = False
    assert counts[exact].sum() == 0
    # binomial counts: mean `expected`, sd below sqrt(expected); a fixed stride without the wrap
    # would leave the tail at 0 (candidates 100) and a stride pattern would show as a far mean
    assert abs(float(counts[rest].mean()) - expected) < 0.05 * expected
    assert float(counts[rest].min()) > expected - 6 * expected ** 0.5


def test_the_strided_draw_estimates_the_full_softmax(layers: LearnedLayers) -> None:
    """As test_learning_candidates' uniform draw: the mean loss over draws is the full softmax's,
    and the step learns through the strided views (no gathered copy) as through gathered rows."""
    prompt, target = [5, 80, 23, 311, 42, 17, 260, 9, 131, 77], [7, 8, 9, 10]
    full_learner = InstantLearner(layers, InstantConfig(layers=1, candidates=0))
    prep = full_learner.prepare(prompt, target)
    with torch.no_grad():
        rows = full_learner._rows(prep, None)
        full = float(F.cross_entropy(rows @ layers.head.t(), torch.tensor(target)))
    strided = InstantLearner(layers, InstantConfig(layers=1, candidates=32, hard_negatives=8, draw="strided"))
    sprep = strided.prepare(prompt, target)
    with torch.no_grad():
        losses = [float(F.cross_entropy(*strided._logits(rows, torch.tensor(target), sprep.negatives)))
                  for _ in range(200)]
    assert abs(sum(losses) / len(losses) - full) < 0.1 * full
    state = strided.new_tenant(seed=1)
    before = [p.detach().clone() for p in state.lora.parameters()]
    timing = strided.step(state, sprep, 1.0)
    assert timing.loss > 0 and any(not torch.equal(p, q) for p, q in zip(state.lora.parameters(), before))
