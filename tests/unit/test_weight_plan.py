"""The weight plan (models/weight_plan.py) is what a load holds: every architecture's layout (q/k
norms, q/k/v biases, tied embeddings) and quantization, to the byte."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from ruvllm.config import QuantConfig
from ruvllm.models.random_weights import random_weights
from ruvllm.models.registry import build_model, weight_bytes
from ruvllm.models.weight_plan import float_weight_plan
from tests.engine_fixtures import TINY_GQA

LAYOUTS = {"llama": {}, "llama tied": dict(tie_word_embeddings=True), "qwen2": dict(attention_bias=True),
           "qwen3": dict(qk_norm=True)}


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("method", ["none", "int8", "int4", "w8a8"])
def test_plan_is_what_the_load_holds(layout: str, method: str) -> None:
    cfg = dataclasses.replace(TINY_GQA, architecture=layout.split()[0], **LAYOUTS[layout])
    quant = QuantConfig(method, group_size=32)
    plan = float_weight_plan(cfg, quant, torch.float32)
    model = build_model(cfg, random_weights(cfg, torch.float32, "cpu"), "tiny", 64, torch.float32, plan=plan)
    assert weight_bytes(model) == plan.total_bytes
    linears = 4 * cfg.num_layers + (0 if cfg.tie_word_embeddings else 1)  # a tied head stays 16-bit by default
    assert sum(plan.linear_forms().values()) == linears
    if method == "none":
        assert set(plan.linear_forms()) == {"dense float32"}
