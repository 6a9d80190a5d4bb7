"""The learned layers as one C++ call each way (learning/whole_layers.py, issue 37 item 1, session 19)
against the autograd path they replace (LearnedLayers(whole=False): one node a projection, norm,
RoPE split, attention), on the default model's packed weights: the same kernels in the same order,
so the rows are bitwise the autograd path's and the micro-LoRA's gradients its sums in its order;
an instant step leaves the same weights; and where the call does not apply (float weights, a
layer with q/k norms or its own family's form) the autograd path runs."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ruvllm.cpu_build import kernels
from ruvllm.learning.config import InstantConfig
from ruvllm.learning.instant import InstantLearner
from ruvllm.learning.tail import LearnedLayers, hidden_before
from tests.lora_fixtures import nonzero_b

pytestmark = pytest.mark.skipif(kernels() is None, reason="our C++ kernels do not build here")

PROMPT = [1, 9690, 198, 2683, 314, 260, 3575, 282, 34106, 47, 2, 198]
TARGET = [504, 3575, 282, 34106, 314, 2]


@pytest.fixture(scope="module")
def model():
    from ruvllm.learning.tail import load_learning_model
    from ruvllm.loader.source import resolve_model

    return load_learning_model(resolve_model(None))[0]


@pytest.fixture(scope="module")
def pair(model):  # noqa: ANN001, ANN201
    """The default learned layers with the call, and without it (the autograd path): made once (each
    makes its 15 transposed 8-bit copies)."""
    n = InstantConfig().layers
    return LearnedLayers(model, n), LearnedLayers(model, n, whole=False)


def _rows_and_grads(layers: LearnedLayers, context: str, seed: int = 3):  # noqa: ANN202
    learner = InstantLearner(layers, InstantConfig(context=context, candidates=0))
    state = learner.new_tenant(seed=seed)
    nonzero_b(state.lora, 0.05)
    prep = learner.prepare(PROMPT, TARGET)
    rows = learner._rows(prep, state.lora)
    loss = F.cross_entropy(rows @ layers.head.t(), torch.tensor(TARGET))
    return rows.detach(), torch.autograd.grad(loss, state.lora.parameters())


@pytest.mark.parametrize("backward", ["int8", "float32"])
def test_the_whole_layers_are_the_autograd_path(model, pair, backward: str) -> None:  # noqa: ANN001
    whole, graph = pair if backward == "int8" else (LearnedLayers(model, InstantConfig().layers, backward),
                                                    LearnedLayers(model, InstantConfig().layers, backward, whole=False))
    assert whole._whole is not None and graph._whole is None
    (rows_w, grads_w), (rows_g, grads_g) = _rows_and_grads(whole, "frozen"), _rows_and_grads(graph, "frozen")
    assert torch.equal(rows_w, rows_g)  # the same kernels on the same operands
    assert len(grads_w) == len(grads_g) == 2 * len(InstantConfig().targets) * InstantConfig().layers
    for a, b in zip(grads_w, grads_g):
        assert b.norm() > 0
        assert (a - b).norm() <= 1e-5 * b.norm()


def test_a_sequence_without_a_context_and_the_rows_without_gradients(model, pair) -> None:  # noqa: ANN001
    """A whole sequence (the Fisher's samples: no kept K/V, attention over its own rows) and a pass
    under no_grad (the hard negatives') take the call too, with the autograd path's rows."""
    whole, graph = pair
    lora = InstantLearner(whole, InstantConfig()).new_tenant(seed=4).lora
    nonzero_b(lora, 0.05)
    ids = PROMPT + TARGET
    h = hidden_before(model, ids, whole.first)
    outs, grads = [], []
    for layers in (whole, graph):
        out = layers.forward(h, torch.arange(len(ids)), lora)
        outs.append(out.detach())
        grads.append(torch.autograd.grad(out.square().sum(), lora.parameters()))
        with torch.no_grad():
            assert torch.equal(layers.forward(h, torch.arange(len(ids)), lora), out.detach())
    assert torch.equal(*outs)
    for a, b in zip(*grads):
        assert (a - b).norm() <= 1e-5 * b.norm()


def test_a_step_leaves_the_weights_the_autograd_step_leaves(pair) -> None:  # noqa: ANN001
    config = InstantConfig(candidates=0)
    results = []
    for layers in pair:
        learner = InstantLearner(layers, config)
        state = learner.new_tenant(seed=6)
        prep = learner.prepare(PROMPT, TARGET)
        losses = [learner.step(state, prep, score).loss for score in (1.0, -1.0, 1.0)]
        results.append((losses, [p.detach().clone() for p in state.lora.parameters()]))
    (losses_w, params_w), (losses_g, params_g) = results
    assert losses_w == pytest.approx(losses_g, rel=1e-5)
    for a, b in zip(params_w, params_g):
        assert (a - b).abs().max() <= 1e-5 * b.abs().max() + 1e-8


def test_where_the_call_does_not_apply_the_autograd_path_runs(tmp_path) -> None:  # noqa: ANN001
    """Float weights have no packed codes for the call: the plan is None and the layers learn through
    autograd as before (the tiny model's float layers)."""
    from ruvllm.loader.source import resolve_model
    from ruvllm.quantize.awq_writer import load_float_model
    from tests.engine_fixtures import write_tiny_model

    layers = LearnedLayers(load_float_model(resolve_model(str(write_tiny_model(tmp_path / "base"))), 512)[0], 1)
    assert layers._whole is None
    learner = InstantLearner(layers, InstantConfig(layers=1, candidates=0))
    state = learner.new_tenant(seed=1)
    nonzero_b(state.lora, 0.05)
    prep = learner.prepare([5, 80, 23, 311, 42], [7, 8])
    out = learner._rows(prep, state.lora)
    assert out.grad_fn is not None and "WholeLayers" not in type(out.grad_fn).__name__


def test_the_call_refuses_arguments_out_of_its_layout(model, pair) -> None:  # noqa: ANN001
    """A wrong layout is a RuntimeError from the call's checks, not a read out of bounds."""
    plan, n = pair[0]._whole, len(pair[0].layers)
    h = torch.zeros(3, model.cfg.hidden_size)
    rope = model.rope.for_positions(torch.arange(3))
    cos, sin = [rope[0].contiguous()] * n, [rope[1].contiguous()] * n
    with pytest.raises(RuntimeError, match="slots a layer"):
        kernels().learned_layers_forward(h, plan.weights[:-1], plan.kinds, plan.groups, plan.final_norm, cos, sin,
                                         [None] * 2 * n, plan.windows, [], [], plan.scale, plan.eps, 1.0, *plan.heads)
    with pytest.raises(RuntimeError, match="lora_at"):
        kernels().learned_layers_forward(h, plan.weights, plan.kinds, plan.groups, plan.final_norm, cos, sin,
                                         [None] * 2 * n, plan.windows, [torch.zeros(2, 576), torch.zeros(576, 2)],
                                         [n + 1, 0, 0], plan.scale, plan.eps, 1.0, *plan.heads)
    with pytest.raises(RuntimeError, match="kept"):
        kernels().learned_layers_backward(h, [h], plan.weights, plan.kinds, plan.groups, plan.transposed,
                                          plan.t_groups, plan.final_norm, cos, sin, [None] * 2 * n, plan.windows, [],
                                          [], plan.scale, plan.eps, 1.0, *plan.heads)


@pytest.mark.parametrize("shape", [(12, 576, 310, 2048), (5, 72, 7, 33), (1, 8, 1, 1)],
                         ids=["the default model's step", "odd counts", "one of each"])
@pytest.mark.parametrize("masked", [1, 0, "all"])
def test_the_pooled_drawn_candidates_give_the_full_softmaxs_loss_and_gradient(shape: tuple[int, int, int, int],
                                                                             masked: int | str) -> None:
    """learning/sampled_logits.py: the drawn candidates' columns pooled into their log-sum-exp (our
    C++) against every column as its own logit (torch), masked columns left out: the same
    cross-entropy and unlikelihood over the exact candidates, and the same gradient of the rows."""
    from ruvllm.learning.instant import feedback_loss
    from ruvllm.learning.sampled_logits import sampled_logits

    t, h, m, n = shape
    g = torch.Generator().manual_seed(7)
    exact, drawn = torch.randn(m, h, generator=g), torch.randn(n, h, generator=g) * 0.5
    mask = torch.zeros(n, dtype=torch.bool)
    if masked == "all":
        mask[:] = True
    elif masked:
        mask[n // 2] = True
    rows, index = torch.randn(t, h, generator=g), torch.arange(t) % m
    for score in (1.0, -1.0):
        results = []
        for pooled in (True, False):
            x = rows.clone().requires_grad_()
            if pooled:
                logits = sampled_logits(x, exact, drawn, 2.5, mask, kernels())
                assert logits.shape == (t, m + 1)
            else:
                logits = torch.cat([x @ exact.t(), (x @ drawn.t() + 2.5).masked_fill(mask, float("-inf"))], dim=1)
            loss = feedback_loss(logits, index, score)
            loss.backward()
            results.append((float(loss), x.grad))
        (loss_p, grad_p), (loss_r, grad_r) = results
        assert loss_p == pytest.approx(loss_r, rel=1e-5, abs=1e-6)
        assert torch.isfinite(grad_p).all()
        assert (grad_p - grad_r).norm() <= 1e-5 * grad_r.norm() + 1e-7
