"""Session 17's cuts to the instant step (issue 37 item 1): a packed projection with its micro-LoRA
pieces as one autograd node (packed_linear.PackedLoraMatmul) computes what the packed matmul and the
deltas as separate torch ops compute, forward and backward; the 8-bit backward; and the learned
layers' element-wise ops, each one autograd node (backward in C++ since session 18), against the
torch reference."""

from __future__ import annotations


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
from tests.lora_fixtures import nonzero_b

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


@needs_kernels
@pytest.mark.parametrize("form", ["int4/32", "int4/64", "int8 per channel"])
def test_the_transposed_8bit_copy_gives_the_input_gradient(form: str) -> None:
    """dequantize reads the packed codes as the kernels do (the float32 backward of identity rows is
    W itself); the 8-bit backward over transposed_q8(W) is dY . W within its rounding (dY and the
    copy to 8 bits a block: ~1% of the norm), and each of its rows is the same alone and batched."""
    from ruvllm.learning.packed_linear import grad_input, transposed_q8
    from ruvllm.quant.cpu_matmul import dequantize
    from ruvllm.quant.rtn import quantize_int8

    g = torch.Generator().manual_seed(11)
    w = torch.randn(96, 128, generator=g) * 0.05
    qw = {"int4/32": lambda: quantize_int4(w, 32), "int4/64": lambda: quantize_int4(w, 64),
          "int8 per channel": lambda: quantize_int8(w)}[form]()
    packed = cpu_matmul.pack(qw)
    assert torch.allclose(dequantize(packed), grad_input(torch.eye(96), packed), rtol=0, atol=1e-6)
    assert torch.allclose(dequantize(packed), qw.dequantize(), rtol=0, atol=1e-3 * float(w.abs().max()))
    wt = transposed_q8(packed)
    dy = torch.randn(13, 96, generator=g)
    exact = dy.double() @ dequantize(packed).double()
    got = grad_input(dy, packed, wt)
    assert float((got.double() - exact).norm() / exact.norm()) < 0.02
    for t in (0, 6, 12):
        assert torch.equal(grad_input(dy[t:t + 1], packed, wt)[0], got[t])


@needs_kernels
def test_autograd_runs_the_8bit_backward() -> None:
    from ruvllm.learning.packed_linear import grad_input, transposed_q8

    g = torch.Generator().manual_seed(12)
    packed = cpu_matmul.pack(quantize_int4(torch.randn(64, 96, generator=g), 32))
    wt = transposed_q8(packed)
    dy = torch.randn(5, 64, generator=g)
    x = torch.randn(5, 96, generator=g, requires_grad=True)
    packed_linear(x, packed, None, wt).backward(dy)
    assert torch.equal(x.grad, grad_input(dy, packed, wt))
    a, b = torch.randn(2, 96, generator=g, requires_grad=True), torch.randn(64, 2, generator=g, requires_grad=True)
    x.grad = None
    packed_lora_linear(x, packed, None, 2.0, [(0, 64, a, b)], wt).backward(dy)
    assert torch.allclose(x.grad, grad_input(dy, packed, wt) + 2.0 * (dy @ b) @ a, atol=1e-5)


@pytest.fixture(scope="module")
def layers(tmp_path_factory: pytest.TempPathFactory) -> LearnedLayers:
    from ruvllm.loader.source import resolve_model
    from ruvllm.quantize.awq_writer import load_float_model

    src = resolve_model(str(write_tiny_model(tmp_path_factory.mktemp("fused") / "base")))
    return LearnedLayers(load_float_model(src, 512)[0], 1)


@needs_kernels
def test_each_learner_op_is_the_torch_reference_forward_and_backward() -> None:
    """learning/fused_ops.py: our kernels forward and a written-out backward, against the torch
    reference ops' autograd (layers/ops.py torch_ops), on random inputs at a dozen rows."""
    from ruvllm.layers.ops import torch_ops
    from ruvllm.layers.rotary import RotaryEmbedding
    from ruvllm.learning.fused_ops import learner_ops

    ref, ours = torch_ops(), learner_ops(kernels())
    g = torch.Generator().manual_seed(21)
    t, hidden, hq, hkv, d = 12, 96, 6, 2, 16
    weight = torch.rand(hidden, generator=g) + 0.5
    cos, sin = RotaryEmbedding(d, 64, 10000.0, None, torch.float32).for_positions(torch.arange(30, 30 + t))
    cases = {
        "add_rms_norm": ([t, hidden], [t, hidden], lambda ops, x, r: ops.add_rms_norm(x, r, weight, 1e-5)),
        "rms_norm (no residual)": ([t, hidden], None, lambda ops, x, r: ops.add_rms_norm(x, None, weight, 1e-5)),
        "silu_and_mul": ([t, 2 * hidden], None, lambda ops, x, r: (ops.silu_and_mul(x),)),
        "qkv_rope": ([t, (hq + 2 * hkv) * d], None, lambda ops, x, r: ops.qkv_rope(x, cos, sin, hq, hkv, d)),
    }
    for name, (shape, rshape, run) in cases.items():
        x = torch.randn(shape, generator=g)
        r = None if rshape is None else torch.randn(rshape, generator=g)
        results = []
        for ops in (ours, ref):
            xi = x.clone().requires_grad_()
            ri = None if r is None else r.clone().requires_grad_()
            outs = run(ops, xi, ri)
            # every output takes a gradient (a weighted sum of all of them), as in the layer
            loss = sum((o * torch.linspace(-1, 1, o.numel()).reshape(o.shape)).sum() for o in outs)
            inputs = [xi] + ([] if ri is None else [ri])
            results.append(([o.detach() for o in outs], torch.autograd.grad(loss, inputs)))
        (outs_o, grads_o), (outs_r, grads_r) = results
        for a, b in zip(outs_o, outs_r):
            assert (a - b).abs().max() <= 1e-5 * b.abs().max(), name
        for a, b in zip(grads_o, grads_r):
            assert (a - b).abs().max() <= 1e-4 * b.abs().max(), name


@needs_kernels
@pytest.mark.parametrize("used", [(0,), (1,), (0, 2), (2,)], ids=["first only", "second only", "first and third",
                                                                "third only"])
def test_the_learner_ops_backward_where_some_outputs_take_no_gradient(used: tuple[int, ...]) -> None:
    """The C++ backward passes (learning/csrc/element_grad.cpp) where autograd hands an output no
    gradient (None): the residual sum alone or the norm alone, q or k or v alone, against the reference."""
    from ruvllm.layers.ops import torch_ops
    from ruvllm.layers.rotary import RotaryEmbedding
    from ruvllm.learning.fused_ops import learner_ops

    ref, ours = torch_ops(), learner_ops(kernels())
    g = torch.Generator().manual_seed(22)
    t, hidden, hq, hkv, d = 7, 64, 4, 2, 16
    weight = torch.rand(hidden, generator=g) + 0.5
    cos, sin = RotaryEmbedding(d, 64, 10000.0, None, torch.float32).for_positions(torch.arange(3, 3 + t))
    x, r = torch.randn(t, hidden, generator=g), torch.randn(t, hidden, generator=g)
    qkv = torch.randn(t, (hq + 2 * hkv) * d, generator=g)
    for name, inputs, run in (("add_rms_norm", (x, r), lambda ops, a, b: ops.add_rms_norm(a, b, weight, 1e-5)),
                              ("qkv_rope", (qkv,), lambda ops, a: ops.qkv_rope(a, cos, sin, hq, hkv, d))):
        results = []
        for ops in (ours, ref):
            leaves = [i.clone().requires_grad_() for i in inputs]
            outs = run(ops, *leaves)
            picked = [outs[i] for i in used if i < len(outs)]
            if not picked:
                continue
            loss = sum((o * torch.linspace(-1, 1, o.numel()).reshape(o.shape)).sum() for o in picked)
            results.append(torch.autograd.grad(loss, leaves, allow_unused=True))
        for a, b in zip(*results):
            assert (a - b).abs().max() <= 1e-4 * b.abs().max(), name


@needs_kernels
@pytest.mark.parametrize("kept, window", [(0, None), (9, None), (9, 6)], ids=["own rows", "kept context", "window"])
def test_row_attention_is_causal_attention_forward_and_backward(kept: int, window: int | None) -> None:
    """learning/row_attention.py (one C++ call each way) against causal_attention's autograd: the
    output, and the gradients of the new rows' q, k and v and of the context's K/V; grouped K/V
    heads; a row's output the same alone as among others."""
    from ruvllm.learning.row_attention import row_attention
    from ruvllm.models.llama import causal_attention

    g = torch.Generator().manual_seed(23)
    t, hq, hkv, d, scale = 12, 6, 2, 16, 0.25
    q, k, v = (torch.randn(t, h, d, generator=g) for h in (hq, hkv, hkv))
    context = (torch.randn(kept, hkv, d, generator=g), torch.randn(kept, hkv, d, generator=g)) if kept else None
    do = torch.randn(t, hq, d, generator=g)
    results = []
    for fn in (lambda *a: row_attention(*a, kernels()), lambda *a: causal_attention(*a[:4], a[4], 1, a[5])):
        leaves = [x.clone().requires_grad_() for x in (q, k, v) + (context or ())]
        o = fn(*leaves[:3], scale, window, tuple(leaves[3:]) or None)
        results.append((o.detach(), torch.autograd.grad(o, leaves, do)))
    (o_ours, g_ours), (o_ref, g_ref) = results
    assert (o_ours - o_ref).abs().max() <= 1e-5 * o_ref.abs().max()
    for a, b in zip(g_ours, g_ref):
        assert (a - b).abs().max() <= 1e-4 * b.abs().max()
    # the first 5 rows alone: what a row sees does not depend on the rows after it
    alone = row_attention(q[:5], k[:5], v[:5], scale, window, context, kernels())
    assert torch.equal(alone, o_ours[:5])


@needs_kernels
@pytest.mark.parametrize("context", ["full", "frozen"])
def test_the_learned_layers_with_the_learner_ops_learn_as_with_the_reference(layers: LearnedLayers,
                                                                            context: str) -> None:
    """The learned layers (the tiny model's last, float weights) with learner_ops (the default where
    the kernels build) against the torch reference ops: the rows and the micro-LoRA's gradients."""
    from ruvllm.layers.ops import torch_ops

    assert layers.ops.name.startswith("learner")
    reference = LearnedLayers(layers.model, 1, ops=torch_ops())
    prompt, target = [5, 80, 23, 311, 42, 17, 260, 9, 131, 77], [7, 8, 9, 10]
    config = InstantConfig(layers=1, candidates=0, context=context)
    results = []
    for which in (layers, reference):
        learner = InstantLearner(which, config)
        state = learner.new_tenant(seed=5)
        nonzero_b(state.lora, 0.05)
        prep = learner.prepare(prompt, target)
        rows = learner._rows(prep, state.lora)
        loss = F.cross_entropy(rows @ which.head.t(), torch.tensor(target))
        results.append((rows.detach(), torch.autograd.grad(loss, state.lora.parameters())))
    (rows_o, grads_o), (rows_r, grads_r) = results
    assert (rows_o - rows_r).abs().max() <= 1e-4 * rows_r.abs().max()
    for a, b in zip(grads_o, grads_r):
        assert b.norm() > 0
        assert (a - b).norm() <= 1e-3 * b.norm()
