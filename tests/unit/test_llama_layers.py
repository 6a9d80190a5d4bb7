"""The decoder's layer loop in C++ (models/csrc/llama_layers.cpp, models/cpu_layer_loop.py): it calls
the kernels the Python loop calls, so generations through it are bitwise the Python loop's, on the
tiny fp32 model (dense kernel), on the default model (packed Q4_1 layers) and on a tiny random
Gemma 3 (sandwich and q/k norms, GELU-tanh, sliding and global layers in three KV groups, a window
shorter than the prompts); RoPE's fused cache write stores what qkv_rope + index_copy_ store; and
the fused q/k norm computes what F.rms_norm and the torch RoPE compute."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from ruvllm import SamplingParams
from ruvllm.config import SchedulerConfig
from ruvllm.cpu_build import kernels
from ruvllm.layers.rotary import RotaryEmbedding
from ruvllm.models.cpu_layer_loop import DENSE, INT4, CpuLayerLoop
from tests.engine_fixtures import TINY_GQA, is_tiny, tiny_llm

ops = kernels()
pytestmark = pytest.mark.skipif(ops is None, reason="no C++ compiler: the kernels cannot be built")


def one_layer_call() -> tuple:
    """llama_layers' arguments for one random dense Llama layer (H 64, 4 query heads and 2 KV heads of
    16; no q/k norms or post-norms), five prompt rows of one sequence, one RoPE table and KV group."""
    g = torch.Generator().manual_seed(0)

    def w(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * 0.1

    weights = [w(64) + 1, w(128, 64), None, None, None, w(64, 64), None, None, None,
               w(64) + 1, w(192, 64), None, None, None, w(64, 96), None, None, None, None, None, None, None]
    angles = torch.arange(5)[:, None, None] * torch.linspace(0.1, 1, 16)
    return (w(5, 64), weights, [DENSE] * 4, [0] * 4, [torch.zeros(32, 2, 16)], [torch.zeros(32, 2, 16)],
            w(64) + 1, [angles.cos()], [angles.sin()], [0], [torch.arange(5)], [torch.tensor([[0, 1]])],
            [torch.zeros(5, dtype=torch.long)], [torch.arange(1, 6)], [0], [0], 16, 0.25, 1e-5, 4, 2, 16, False,
            [], [], None)


def _model(llm):  # noqa: ANN001, ANN202
    return llm.core.executor.runner.model


def _generate(llm) -> list:  # noqa: ANN001
    """Greedy generations of prompts of different lengths, together (prompt chunks beside decodes),
    with their top logprobs."""
    prompts = ["Hello, my name is", "The capital of France is", "Once upon a time, in a land far away, there lived a",
               "1, 2, 3, 4,"]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=10, logprobs=3, ignore_eos=True))
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]


def test_generations_through_the_cpp_loop_are_the_python_loops(precision_llm, monkeypatch) -> None:  # noqa: ANN001
    model = _model(precision_llm)
    if model.norm.weight.dtype != torch.float32:  # a CPU with native bf16: the default dtype is bf16
        pytest.skip("the C++ layer loop runs float32 models; the default dtype on this CPU is "
                    f"{str(model.norm.weight.dtype).removeprefix('torch.')}")
    loop = model._layer_loop()
    assert loop is not None, "the C++ loop should apply to this model on this CPU"
    assert set(loop.kinds) == ({DENSE} if is_tiny(precision_llm) else {INT4})
    steps = []
    run = CpuLayerLoop.__call__
    monkeypatch.setattr(CpuLayerLoop, "__call__", lambda self, *a: steps.append(1) or run(self, *a))
    through_cpp = _generate(precision_llm)
    assert len(steps) >= 10, "every step should have gone through the C++ loop"
    precision_llm.reset_prefix_cache()
    model.__dict__["_loop"] = None  # the Python loop for the same engine
    try:
        through_python = _generate(precision_llm)
    finally:
        model.invalidate_layer_loop()
    assert through_cpp == through_python
    assert model._layer_loop() is not None


def test_moving_the_model_rebuilds_the_loop(_tiny_llm) -> None:  # noqa: ANN001
    model = _model(_tiny_llm)
    first = model._layer_loop()
    model.to(torch.float32)  # a no-op move still goes through _apply
    assert "_loop" not in model.__dict__
    assert model._layer_loop() is not first


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_cache_write_stores_what_index_copy_stores(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    qkv = torch.randn(6, (9 + 2 * 3) * 16).to(dtype)
    cos, sin = (torch.randn(6, 1, 16).to(dtype) for _ in range(2))
    slots = torch.tensor([40, 3, 17, 18, 0, 63])
    q, k, v = ops.qkv_rope(qkv, cos, sin, 9, 3, 16)
    k_ref, v_ref = torch.randn(64, 3, 16).to(dtype), torch.randn(64, 3, 16).to(dtype)
    k_cache, v_cache = k_ref.clone(), v_ref.clone()
    k_ref.index_copy_(0, slots, k)
    v_ref.index_copy_(0, slots, v)
    q2 = ops.qkv_rope_cache(qkv, cos, sin, 9, 3, 16, k_cache, v_cache, slots)
    assert torch.equal(q2, q) and torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)


def test_rope_cache_write_refuses_a_slot_outside_the_cache() -> None:
    qkv = torch.randn(2, 15 * 16)
    cos, sin = torch.randn(2, 1, 16), torch.randn(2, 1, 16)
    caches = torch.zeros(8, 3, 16), torch.zeros(8, 3, 16)
    with pytest.raises(RuntimeError, match="slot 8 is outside the cache"):
        ops.qkv_rope_cache(qkv, cos, sin, 9, 3, 16, *caches, torch.tensor([0, 8]))


# Six layers, globals at 2 and 5 (Gemma 3's pattern is every sixth): three KV groups, (2, 5), (0, 1)
# and (3, 4), each with its own block tables; the sliding ones see 12 keys, fewer than the prompts.
TINY_GEMMA = dataclasses.replace(
    TINY_GQA, architecture="gemma3", num_layers=6, qk_norm=True, sliding_layers=(0, 1, 3, 4), sliding_window=12,
    rope_theta=1e6, rope_local_theta=1e4, query_pre_attn_scalar=64.0, final_logit_softcapping=30.0,
    tie_word_embeddings=True, rms_norm_eps=1e-6)


# Qwen3: the Llama layer with q/k norms (which the C++ loop takes since they run in qkv_rope).
TINY_QWEN3 = dataclasses.replace(TINY_GQA, architecture="qwen3", num_layers=3, qk_norm=True)


@pytest.fixture(scope="module", params=["gemma3", "qwen3"])
def tiny_qk_llm(request: pytest.FixtureRequest):  # noqa: ANN201
    """The tiny Gemma 3 (or Qwen3), its norms drawn around 1 (random_weights makes them all 1: a q
    norm used for k, or a post-norm skipped, would not show); prompt chunks of at most 24 tokens
    beside decodes."""
    cfg = TINY_GEMMA if request.param == "gemma3" else TINY_QWEN3
    llm = tiny_llm("cpu", cfg=cfg, scheduler=SchedulerConfig(max_num_batched_tokens=24, max_num_seqs=8))
    model = _model(llm)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.mul_(1 + 0.3 * torch.randn(p.shape, generator=g))
    model.invalidate_layer_loop()
    return llm


def test_gemma3_and_qwen3_through_the_cpp_loop_are_the_python_loop(tiny_qk_llm, monkeypatch) -> None:  # noqa: ANN001
    """Every step's final hidden states, bitwise: prompts of 5 to 40 tokens (past Gemma's window),
    chunked beside decodes, then decoded together."""
    llm, model = tiny_qk_llm, _model(tiny_qk_llm)
    loop = model._layer_loop()
    assert loop is not None and model.cfg.qk_norm
    if model.cfg.architecture == "gemma3":
        assert loop.form.gelu_tanh and loop.form.post_norms
        assert len(set(model.kv_group)) == 3 and model.local_rope is not model.rope
    hidden: list[torch.Tensor] = []
    forward = model.forward
    monkeypatch.setattr(model, "forward", lambda *a: hidden.append(forward(*a).clone()) or hidden[-1])
    steps = []
    run = CpuLayerLoop.__call__
    monkeypatch.setattr(CpuLayerLoop, "__call__", lambda self, *a: steps.append(1) or run(self, *a))
    prompts = [[(7 * i + 3 * j) % 500 + 2 for j in range(n)] for i, n in enumerate((5, 40, 17, 31))]
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)

    def generate() -> list[list[int]]:
        return [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)]

    through_cpp, cpp_hidden = generate(), list(hidden)
    assert len(steps) == len(cpp_hidden) >= 12, "every step should have gone through the C++ loop"
    assert max(len(h) for h in cpp_hidden) == 24  # a step of prompt chunks (and decodes)
    llm.reset_prefix_cache()
    hidden.clear()
    model.__dict__["_loop"] = None  # the Python loop for the same engine
    try:
        through_python = generate()
    finally:
        model.invalidate_layer_loop()
    assert len(steps) == len(cpp_hidden)  # none of these through the C++ loop
    assert through_cpp == through_python
    assert len(hidden) == len(cpp_hidden)
    assert all(torch.equal(a, b) for a, b in zip(cpp_hidden, hidden))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_qk_norm_computes_the_norm_then_rope(dtype: torch.dtype) -> None:
    """qkv_rope with q/k norm weights: F.rms_norm over each head, then the torch RoPE (to rounding;
    the C++ and Python loops both call this kernel, so they agree bitwise), and the cache-writing
    form stores the same k and v and returns the same q."""
    torch.manual_seed(0)
    hq, hkv, d, eps = 4, 2, 32, 1e-6
    qkv = torch.randn(5, (hq + 2 * hkv) * d).to(dtype)
    qw, kw = (1 + 0.3 * torch.randn(d)).to(dtype), (1 + 0.3 * torch.randn(d)).to(dtype)
    angles = torch.arange(5)[:, None, None] * torch.linspace(0.1, 1, d // 2).repeat(2)
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    q, k, v = ops.qkv_rope(qkv, cos, sin, hq, hkv, d, qw, kw, eps)
    f = qkv.float()
    q_ref, k_ref = RotaryEmbedding.apply(
        torch.nn.functional.rms_norm(f[:, :hq * d].view(5, hq, d), (d,), qw.float(), eps),
        torch.nn.functional.rms_norm(f[:, hq * d:(hq + hkv) * d].view(5, hkv, d), (d,), kw.float(), eps),
        (cos.float(), sin.float()))
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(q.float(), q_ref, atol=tol, rtol=tol)
    torch.testing.assert_close(k.float(), k_ref, atol=tol, rtol=tol)
    assert torch.equal(v, qkv[:, (hq + hkv) * d:].reshape(5, hkv, d))
    slots = torch.tensor([9, 0, 4, 13, 2])
    k_cache, v_cache = torch.zeros(16, hkv, d, dtype=dtype), torch.zeros(16, hkv, d, dtype=dtype)
    q2 = ops.qkv_rope_cache(qkv, cos, sin, hq, hkv, d, k_cache, v_cache, slots, qw, kw, eps)
    assert torch.equal(q2, q) and torch.equal(k_cache[slots], k) and torch.equal(v_cache[slots], v)
    with pytest.raises(RuntimeError, match="both or neither"):
        ops.qkv_rope(qkv, cos, sin, hq, hkv, d, qw, None, eps)
