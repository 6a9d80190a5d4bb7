"""The decoder's layer loop in C++ (models/csrc/llama_layers.cpp, models/cpu_layer_loop.py): it calls
the kernels the Python loop calls, so generations through it are bitwise the Python loop's, on the
tiny fp32 model (dense kernel) and on the default model (packed Q4_1 layers); and RoPE's fused cache
write stores what qkv_rope + index_copy_ store."""

from __future__ import annotations

import pytest
import torch

from ruvllm import SamplingParams
from ruvllm.cpu_build import kernels
from ruvllm.models.cpu_layer_loop import DENSE, INT4, CpuLayerLoop
from tests.engine_fixtures import is_tiny

ops = kernels()
pytestmark = pytest.mark.skipif(ops is None, reason="no C++ compiler: the kernels cannot be built")


def one_layer_call() -> tuple:
    """llama_layers' arguments for one random dense layer (H 64, 4 query heads and 2 KV heads of 16),
    five prompt rows of one sequence."""
    g = torch.Generator().manual_seed(0)

    def w(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * 0.1

    weights = [w(64) + 1, w(128, 64), None, None, None, w(64, 64), None, None, None,
               w(64) + 1, w(192, 64), None, None, None, w(64, 96), None, None, None]
    angles = torch.arange(5)[:, None, None] * torch.linspace(0.1, 1, 16)
    return (w(5, 64), weights, [DENSE] * 4, [0] * 4, [torch.zeros(32, 2, 16)], [torch.zeros(32, 2, 16)],
            w(64) + 1, angles.cos(), angles.sin(), torch.arange(5), torch.tensor([[0, 1]]),
            torch.zeros(5, dtype=torch.long), torch.arange(1, 6), 16, 0.25, 1e-5, 4, 2, 16, [], [], None)


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
