"""llama.cpp's Q8_0 and Q4_K applied at load (`-q q8`, `-q q4k`) on the default model: every
projection runs packed, the answer still makes sense, and the teacher-forced logprobs stay close to
the fp32 reference on the same (dequantized Q4_1) weights."""

from __future__ import annotations

import pytest

from ruvllm import LLM, SamplingParams
from ruvllm.quant.linear import QuantLinear
from tests.e2e.test_quantized import _prompt_logprobs

# Measured (mean / max |difference| in nats, against fp32): q8 0.072 / 0.31, q4k 0.21 / 1.00; dense
# bf16 gives 0.043 / 0.15. q4k rounds weights already on Q4_1's grids a second time, onto grids with
# 6-bit sub-block scales that cannot hold them. A broken path is off by many nats.
BOUNDS = {"q8": (0.15, 0.6), "q4k": (0.4, 1.8)}


@pytest.mark.parametrize("method", ["q8", "q4k"])
def test_llamacpp_format_on_the_default_model(llm: LLM, method: str) -> None:
    quant = LLM(quantization=method, num_blocks=32)
    layer = quant.model.layers[5]
    for proj in (layer.qkv_proj, layer.o_proj, layer.gate_up_proj, layer.down_proj):
        assert isinstance(proj, QuantLinear) and proj.group_size == 32
        assert proj.kind == ("int8" if method == "q8" else "int4")
    text = quant.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=8))[0].outputs[0].text
    assert "Paris" in text, text
    diff = (_prompt_logprobs(quant) - _prompt_logprobs(llm)).abs()
    mean, top = BOUNDS[method]
    assert diff.mean() < mean and diff.max() < top, (float(diff.mean()), float(diff.max()))
    assert quant.stats().free_blocks == quant.stats().total_blocks
