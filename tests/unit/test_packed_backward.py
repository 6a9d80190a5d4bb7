"""The learner's backward over the served packed weights (issue 37): our C++ input gradient is
dY . W of the dequantized weight, computes each row alike alone or batched, and autograd runs it;
and on the default model (its GGUF's own Q4_1 codes) an instant step's loss and micro-LoRA
gradients are those of a float32 autograd reference over the same weights, dequantized; and the
full context's pass that skips the last layer's unread rows is the whole pass's.

The stated tolerance of the step: the packed forward rounds each activation row to 8 bits per block
of 32 (as serving does), which the reference does not, so the two differ by that rounding: the loss
within 2%, each gradient within 10% of its norm (measured: 0.4% (full context), 1.2% (frozen), and
at most 4.5%). The 8-bit backward (LearnedLayers(backward="int8"), the default since session 17)
rounds dY and a transposed copy of the weights to 8 bits a block as well: checked to the same
tolerance (its distances printed with -s; docs/learning.md)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ruvllm.cpu_build import kernels
from ruvllm.learning.config import InstantConfig
from ruvllm.learning.packed_linear import grad_input, packed_linear
from ruvllm.quant import cpu_matmul
from ruvllm.quant.llamacpp import quantize_q8
from ruvllm.quant.rtn import quantize_int4, quantize_int8
from tests.lora_fixtures import nonzero_b

pytestmark = pytest.mark.skipif(kernels() is None, reason="our C++ kernels do not build here")

FORMS = {"int4/32": lambda w: quantize_int4(w, 32), "int4/64": lambda w: quantize_int4(w, 64),
         "int8 per channel": quantize_int8, "int8/32 (Q8_0)": quantize_q8}


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("shape", [(256, 192), (68, 1536)])
def test_grad_input_is_dy_times_the_dequantized_weight(form: str, shape: tuple[int, int]) -> None:
    g = torch.Generator().manual_seed(0)
    qw = FORMS[form](torch.randn(*shape, generator=g))
    packed, w = cpu_matmul.pack(qw), qw.dequantize().float()
    for rows in (1, 5, 12, 13):
        dy = torch.randn(rows, shape[0], generator=g)
        expected = dy.double() @ w.double()
        got = grad_input(dy, packed)
        assert got.shape == (rows, shape[1])
        assert (got.double() - expected).abs().max() <= 1e-5 * expected.abs().max()


def test_each_row_is_the_same_alone_and_batched() -> None:
    g = torch.Generator().manual_seed(1)
    packed = cpu_matmul.pack(quantize_int4(torch.randn(192, 576, generator=g), 32))
    dy = torch.randn(13, 192, generator=g)
    batched = grad_input(dy, packed)
    for i in range(13):
        assert torch.equal(grad_input(dy[i:i + 1].clone(), packed)[0], batched[i])
    assert torch.equal(grad_input(dy[3:10].contiguous(), packed), batched[3:10])


def test_autograd_runs_the_packed_backward() -> None:
    g = torch.Generator().manual_seed(2)
    packed = cpu_matmul.pack(quantize_int4(torch.randn(64, 96, generator=g), 32))
    x = torch.randn(7, 96, generator=g, requires_grad=True)
    y = packed_linear(x, packed)
    assert torch.equal(y.detach(), cpu_matmul.matmul(x.detach(), packed))  # the engine's forward
    dy = torch.randn(7, 64, generator=g)
    y.backward(dy)
    assert torch.equal(x.grad, grad_input(dy, packed))


@pytest.fixture(scope="module")
def default_models():
    from ruvllm.learning.tail import load_learning_model
    from ruvllm.loader.source import resolve_model

    src = resolve_model(None)
    return load_learning_model(src)[0], load_learning_model(src, packed=False)[0]


@pytest.mark.parametrize("backward", ["int8", "float32"])
@pytest.mark.parametrize("context", ["full", "frozen"])
def test_a_step_on_the_packed_weights_matches_the_float32_reference(default_models, context: str,
                                                                    backward: str) -> None:
    from ruvllm.learning.instant import InstantLearner
    from ruvllm.learning.tail import LearnedLayers
    from ruvllm.quant.linear import QuantLinear

    packed_model, float_model = default_models
    config = InstantConfig(context=context, candidates=0)
    packed_layers = LearnedLayers(packed_model, config.layers, backward)
    float_layers = LearnedLayers(float_model, config.layers)
    assert bool(packed_layers._transposed) == (backward == "int8")
    assert all(isinstance(packed_model.layers[i].down_proj, QuantLinear) for i in packed_layers.layers)
    assert torch.equal(packed_layers.head, float_layers.head)
    prompt, target = [1, 9690, 198, 2683, 314, 260, 3575, 282, 34106, 47, 2, 198], [504, 3575, 282, 34106, 314, 2]
    results = []
    for layers in (packed_layers, float_layers):
        learner = InstantLearner(layers, config)
        state = learner.new_tenant(seed=3)
        nonzero_b(state.lora, 0.05)
        prep = learner.prepare(prompt, target)
        if layers is packed_layers:  # the same hidden states entering the learned layers in both
            float_prep = InstantLearner(float_layers, config).prepare(prompt, target)
            prep.h, prep.context = float_prep.h, float_prep.context
        loss = F.cross_entropy(learner._rows(prep, state.lora) @ layers.head.t(), torch.tensor(target))
        params = state.lora.parameters()
        results.append((float(loss.detach()), torch.autograd.grad(loss, params)))
    (loss_p, grads_p), (loss_f, grads_f) = results
    assert abs(loss_p - loss_f) <= 0.02 * loss_f
    for gp, gf in zip(grads_p, grads_f):
        assert gf.norm() > 0
        assert (gp - gf).norm() <= 0.10 * gf.norm()
    print(f"{context}/{backward}: loss {abs(loss_p - loss_f) / loss_f:.2%}, gradients at most "
          f"{max(float((gp - gf).norm() / gf.norm()) for gp, gf in zip(grads_p, grads_f)):.2%} off")


@pytest.mark.parametrize("form", ["packed", "float32"])
def test_the_last_layer_skips_the_rows_nobody_reads(default_models, form: str) -> None:
    """forward(keep_from=k) is forward()[k:], and learns alike: the prompt's rows at the last layer
    give their K/V (with the micro-LoRA's v_proj delta) and nothing else."""
    from ruvllm.learning.instant import InstantLearner
    from ruvllm.learning.tail import LearnedLayers, hidden_before

    model = default_models[0 if form == "packed" else 1]
    layers = LearnedLayers(model, 2)
    learner = InstantLearner(layers, InstantConfig(layers=2))
    lora = learner.new_tenant(seed=4).lora
    nonzero_b(lora, 0.05)
    ids = [1, 9690, 198, 2683, 314, 260, 3575, 282, 34106, 47, 2, 198, 504, 3575]
    h = hidden_before(model, ids, layers.first)
    outs, grads = [], []
    for keep_from in (0, 9):
        out = layers.forward(h, torch.arange(len(ids)), lora, keep_from=keep_from)
        out = out[9:] if keep_from == 0 else out
        outs.append(out)
        grads.append(torch.autograd.grad(out.square().sum(), lora.parameters()))
    assert outs[0].shape == outs[1].shape == (len(ids) - 9, model.cfg.hidden_size)
    assert (outs[0] - outs[1]).abs().max() <= 1e-4 * outs[0].abs().max()
    for a, b in zip(*grads):
        assert (a - b).norm() <= 1e-4 * b.norm() + 1e-12
