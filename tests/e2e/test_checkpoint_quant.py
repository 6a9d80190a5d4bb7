"""GPTQ and AWQ checkpoints, made here from a tiny random Llama by packing its weights the way each
format documents it (our own packer below, independent of the loader's unpacker), load and match
transformers run on the same (dequantized) weights."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig, LlamaForCausalLM

from ruvllm import LLM, SamplingParams
from ruvllm.errors import CorruptModelError, UnsupportedQuantizationError
from ruvllm.loader import iter_weights, load_tokenizer, resolve_model
from ruvllm.quant.linear import QuantLinear
from ruvllm.quant.weights import QuantizedWeight
from tests.e2e.test_logits_vs_transformers import TINY, _check

GROUP = 32
PROJ = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]  # AWQ writes output column AWQ_ORDER[p] into nibble p


def _pack(values: np.ndarray) -> np.ndarray:
    """[..., 8] values 0..15 -> int32 words, value j in bits 4j..4j+3."""
    word = np.zeros(values.shape[:-1], dtype=np.uint32)
    for j in range(8):
        word |= values[..., j].astype(np.uint32) << np.uint32(4 * j)
    return word.view(np.int32)


def _quantize(w: torch.Tensor, rng: np.random.Generator, act_order: bool):
    """Random-but-fitting int4 codes for w [N, K]: codes [K, N], zeros and scales [G, N], g_idx [K]."""
    n, k = w.shape
    g_idx = np.arange(k) // GROUP
    if act_order:
        g_idx = rng.permutation(g_idx)  # inputs assigned to groups out of order (GPTQ desc_act)
    wt = w.t().double().numpy()
    scales = np.zeros((k // GROUP, n), dtype=np.float16)
    zeros = np.zeros((k // GROUP, n), dtype=np.int64)
    codes = np.zeros((k, n), dtype=np.int64)
    for g in range(k // GROUP):
        rows = g_idx == g
        lo, hi = wt[rows].min(0), wt[rows].max(0)
        s = np.maximum((hi - lo) / 15, 1e-4).astype(np.float16)
        z = np.clip(np.round(-lo / s.astype(np.float64)), 0, 15).astype(np.int64)
        scales[g], zeros[g] = s, z
        codes[rows] = np.clip(np.round(wt[rows] / s.astype(np.float64) + z), 0, 15)
    dense = (codes - zeros[g_idx]) * scales.astype(np.float32)[g_idx]  # [K, N]
    return codes, zeros, scales, g_idx, torch.from_numpy(dense.T.astype(np.float32)).contiguous()


def _make(tmp: Path, method: str, act_order: bool = False) -> tuple[Path, Path]:
    """A quantized checkpoint folder and a dense folder holding exactly its dequantized weights."""
    torch.manual_seed(0)
    rng = np.random.default_rng(0)
    model = LlamaForCausalLM(LlamaConfig(**TINY, num_key_value_heads=2, tie_word_embeddings=False))
    with torch.no_grad():
        model.lm_head.weight.mul_(20.0)  # random init gives tiny logits; keep argmax off rounding noise
    dense_dir, quant_dir = tmp / "dense", tmp / method
    model.save_pretrained(dense_dir)
    tensors = load_file(str(dense_dir / "model.safetensors"))
    quant: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        prefix, _, leaf = name.rpartition(".")
        if leaf != "weight" or prefix.rsplit(".", 1)[-1] not in PROJ:
            quant[name] = t
            continue
        codes, zeros, scales, g_idx, dense = _quantize(t, rng, act_order)
        tensors[name] = dense  # the reference model gets exactly the quantized values
        k, n = codes.shape
        if method == "gptq":
            quant[f"{prefix}.qweight"] = torch.from_numpy(_pack(codes.reshape(k // 8, 8, n).transpose(0, 2, 1)))
            quant[f"{prefix}.qzeros"] = torch.from_numpy(_pack((zeros - 1).reshape(-1, n // 8, 8)))  # v1: z - 1
            quant[f"{prefix}.g_idx"] = torch.from_numpy(g_idx.astype(np.int32))
            quant[f"{prefix}.bias"] = torch.zeros(n, dtype=torch.float16)  # exporters write zero biases
        else:
            order = np.array(AWQ_ORDER)
            quant[f"{prefix}.qweight"] = torch.from_numpy(_pack(codes.reshape(k, n // 8, 8)[:, :, order]))
            quant[f"{prefix}.qzeros"] = torch.from_numpy(_pack(zeros.reshape(-1, n // 8, 8)[:, :, order]))
        quant[f"{prefix}.scales"] = torch.from_numpy(scales)
    save_file(tensors, str(dense_dir / "model.safetensors"), metadata={"format": "pt"})
    quant_dir.mkdir()
    save_file(quant, str(quant_dir / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((dense_dir / "config.json").read_text())
    config["quantization_config"] = (
        {"quant_method": "gptq", "bits": 4, "group_size": GROUP, "desc_act": act_order, "sym": False}
        if method == "gptq" else {"quant_method": "awq", "bits": 4, "group_size": GROUP, "version": "gemm",
                                  "zero_point": True})
    (quant_dir / "config.json").write_text(json.dumps(config))
    return quant_dir, dense_dir


@pytest.mark.parametrize("method", ["gptq", "awq"])
def test_checkpoint_logits_match_transformers_on_its_weights(tmp_path: Path, method: str) -> None:
    quant_dir, dense_dir = _make(tmp_path, method)
    prompt = torch.randint(0, 512, (30,)).tolist()
    # fp32: the checkpoint is dequantized exactly, and must equal transformers on those values.
    _check(resolve_model(quant_dir), prompt, reference=resolve_model(dense_dir))


@pytest.mark.parametrize("method", ["gptq", "awq"])
def test_checkpoint_codes_are_kept_packed(tmp_path: Path, method: str) -> None:
    quant_dir, dense_dir = _make(tmp_path, method)
    dense = load_file(str(dense_dir / "model.safetensors"))
    kept = dict(iter_weights(resolve_model(quant_dir), torch.bfloat16, keep_quantized=True))
    for proj in PROJ:
        name = f"model.layers.1.{'mlp' if 'proj' in proj and proj[0] in 'gud' else 'self_attn'}.{proj}.weight"
        qw = kept[name]
        assert isinstance(qw, QuantizedWeight) and qw.kind == "int4" and qw.group_size == GROUP, name
        torch.testing.assert_close(qw.dequantize(), dense[name], atol=1e-6, rtol=1e-6)
    assert not any(n.endswith(".bias") for n in kept)  # the all-zero GPTQ biases were dropped
    # A tokenizer for the engine (ids below are given directly): the default model's one.
    load_tokenizer(resolve_model(None)).save_pretrained(quant_dir)
    llm = LLM(str(quant_dir), dtype="bfloat16", num_blocks=16)  # auto: computes with the packed codes
    assert isinstance(llm.model.layers[0].qkv_proj, QuantLinear)
    out = llm.generate([[1, 2, 3, 4]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))[0]
    assert len(out.outputs[0].token_ids) == 4
    # `ruvllm info -q` estimates from the headers what this load holds.
    from ruvllm.config import QuantConfig
    from ruvllm.models.weight_plan import weight_plan
    # At the dtype the engine above computes in (auto is fp32 on CPUs without native bf16).
    plan = weight_plan(quant_dir, QuantConfig(), "bfloat16")
    assert plan.total_bytes == llm.info.weight_bytes


def test_act_order_checkpoint_loads_as_int8(tmp_path: Path) -> None:
    quant_dir, dense_dir = _make(tmp_path, "gptq", act_order=True)
    dense = load_file(str(dense_dir / "model.safetensors"))
    kept = dict(iter_weights(resolve_model(quant_dir), torch.bfloat16, keep_quantized=True))
    name = "model.layers.0.self_attn.q_proj.weight"
    qw = kept[name]
    # Groups out of input order cannot be int4 groups of our kernel: per-channel int8, within half a step.
    assert qw.kind == "int8" and qw.group_size == 0
    assert ((qw.dequantize() - dense[name]).abs() <= qw.scales[:, None] / 2 + 1e-6).all()
    # The weight plan reads the layers' g_idx and expects the same (LLM(...) loads by the plan).
    from ruvllm.config import QuantConfig
    from ruvllm.models.weight_plan import weight_plan
    from ruvllm.loader import load_model_config
    from ruvllm.models.registry import build_model, weight_bytes
    src = resolve_model(quant_dir)
    plan = weight_plan(src, QuantConfig(), "bfloat16")
    assert plan.weights["layers.0.qkv_proj.weight"].stored == ("int8", 0)
    model = build_model(load_model_config(src), iter_weights(src, torch.bfloat16, keep_quantized=True), "x", 64,
                        torch.bfloat16, plan=plan)  # each weight checked against the plan as it is installed
    assert weight_bytes(model) == plan.total_bytes
    prompt = torch.randint(0, 512, (20,)).tolist()
    _check(resolve_model(quant_dir), prompt, reference=resolve_model(dense_dir))  # fp32 path is exact


def test_bad_checkpoints_are_refused_clearly(tmp_path: Path) -> None:
    quant_dir, _ = _make(tmp_path, "gptq")
    config = json.loads((quant_dir / "config.json").read_text())
    config["quantization_config"]["bits"] = 8
    (quant_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedQuantizationError, match="8-bit"):
        list(iter_weights(resolve_model(quant_dir), torch.float32))
    config["quantization_config"] = {"quant_method": "hqq"}
    (quant_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedQuantizationError, match="hqq"):
        list(iter_weights(resolve_model(quant_dir), torch.float32))
    config["quantization_config"] = {"quant_method": "gptq", "bits": 4, "group_size": GROUP}
    (quant_dir / "config.json").write_text(json.dumps(config))
    tensors = load_file(str(quant_dir / "model.safetensors"))
    del tensors["model.layers.1.mlp.down_proj.qzeros"]
    save_file(tensors, str(quant_dir / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CorruptModelError, match=r"layers\.1\.mlp\.down_proj lacks qzeros"):
        list(iter_weights(resolve_model(quant_dir), torch.float32))
