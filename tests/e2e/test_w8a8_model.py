"""W8A8 on the default model: every linear runs int8 x int8, the answer still makes sense, and the
teacher-forced logprobs stay close to the fp32 reference."""

from __future__ import annotations

from ruvllm import LLM, SamplingParams
from ruvllm.quant.linear import QuantLinear
from tests.e2e.test_quantized import _prompt_logprobs


def test_w8a8_default_model(llm: LLM) -> None:
    w8a8 = LLM(quantization="w8a8", num_blocks=32)
    layer = w8a8.model.layers[5]
    for proj in (layer.qkv_proj, layer.o_proj, layer.gate_up_proj, layer.down_proj):
        assert isinstance(proj, QuantLinear) and proj.int8_activations
    text = w8a8.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=8))[0].outputs[0].text
    assert "Paris" in text, text
    # Measured: mean |difference| 0.31 nats, max 0.94 with PyTorch's layer ops, 0.40 / 1.57 with our
    # fused C++ ones (perplexity +3.1% and +3.3%): int8 activations without smoothing lose on this
    # model's outlier channels (docs/quantization.md), and which realization of that loss a prompt
    # gets turns on ulps (the Q8_0 embeddings put activations on rounding ties). A broken path is
    # off by many nats.
    diff = (_prompt_logprobs(w8a8) - _prompt_logprobs(llm)).abs()
    assert diff.mean() < 0.5 and diff.max() < 2.0, (float(diff.mean()), float(diff.max()))
    assert w8a8.stats().free_blocks == w8a8.stats().total_blocks
