"""`ruvllm quantize --method smoothquant` on the tiny random Llama of test_awq_quantize (large-activation
channels in every linear group): the written folder is dense, holds the same float model (its fp32
logits equal the source's), loads with -q w8a8 and generates; bad input is one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from ruvllm import LLM, SamplingParams
from ruvllm.loader import resolve_model
from ruvllm.quantize.awq import forward_logits
from ruvllm.quantize.awq_writer import load_float_model
from ruvllm.quant.linear import QuantLinear
from tests.e2e.test_awq_quantize import _ids, calibration, invoke, tiny  # noqa: F401 (fixtures)
from tests.unit.test_cli_models import assert_one_line_error

pytestmark = pytest.mark.usefixtures("wide_terminal")


def test_cli_writes_a_smoothed_float_folder_that_runs_w8a8(tiny: Path, calibration: Path, tmp_path: Path) -> None:
    out = tmp_path / "sq"
    result = invoke("quantize", str(tiny), "--method", "smoothquant", "--calibration", str(calibration),
                    "--output", str(out), "--alpha", "0.6", "--samples", "4", "--seq-len", "64")
    assert result.exit_code == 0, result.output
    assert f"wrote {out} (smoothquant, alpha 0.6, float32" in result.stdout
    assert "W8A8 layer output error vs unsmoothed on them: -" in result.stdout  # the outliers make it pay
    config = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in config and config.get("dtype", config.get("torch_dtype")) == "float32"
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
        norm = f.get_tensor("model.layers.0.input_layernorm.weight")
    assert "model.layers.1.self_attn.k_proj.weight" in names and norm.dtype == torch.float32
    # The same float model: smoothed weights, identical logits in fp32.
    source, _, _ = load_float_model(resolve_model(tiny), 64)
    smoothed, _, _ = load_float_model(resolve_model(out), 64)
    assert not torch.equal(norm, source.layers[0].input_layernorm.weight)
    probe = _ids(tiny, calibration, samples=2)
    before, after = forward_logits(source, probe), forward_logits(smoothed, probe)
    assert (after - before).abs().max().item() < 1e-4 * before.abs().max().item()
    # Loaded with -q w8a8: every projection runs int8 x int8, and it generates.
    llm = LLM(str(out), quantization="w8a8", num_blocks=16)
    layer = llm.model.layers[0]
    for proj in (layer.qkv_proj, layer.o_proj, layer.gate_up_proj, layer.down_proj):
        assert isinstance(proj, QuantLinear) and proj.int8_activations
    got = llm.generate(["It is a truth universally"], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert len(got[0].outputs[0].token_ids) == 4
    # --dtype bfloat16: the same folder at half the size; an existing output needs --force.
    again = ["quantize", str(tiny), "-m", "smoothquant", "-c", str(calibration), "-o", str(out), "--samples", "2",
             "--seq-len", "64", "--dtype", "bfloat16"]
    assert_one_line_error(invoke(*again), "exists and is not empty; pass --force")
    result = invoke(*again, "--force")
    assert result.exit_code == 0, result.output
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        assert f.get_tensor("model.layers.0.input_layernorm.weight").dtype == torch.bfloat16


@pytest.mark.parametrize("args, message", [
    (["--alpha", "1.5"], "--alpha must be between 0 and 1 (exclusive), got 1.5"),
    (["--alpha", "0"], "--alpha must be between 0 and 1 (exclusive), got 0"),
    (["--group-size", "32"], "--group-size applies only to --method awq and rtn"),
    (["--dtype", "int8"], "--dtype must be one of float32, bfloat16, float16"),
])
def test_cli_bad_smoothquant_options_are_one_line(tiny: Path, calibration: Path, tmp_path: Path,
                                                  args: list[str], message: str) -> None:
    out = tmp_path / "out"
    result = invoke("quantize", str(tiny), "-m", "smoothquant", "-c", str(calibration), "-o", str(out), *args)
    assert_one_line_error(result, message)
    assert not out.exists()


def test_cli_smoothquant_needs_calibration_and_its_options_need_it(tiny: Path, tmp_path: Path) -> None:
    out = str(tmp_path / "out")
    assert_one_line_error(invoke("quantize", str(tiny), "-m", "smoothquant", "-o", out),
                          "--method smoothquant needs --calibration FILE")
    assert_one_line_error(invoke("quantize", str(tiny), "-m", "rtn", "-o", out, "--group-size", "32", "--alpha", "0.5"),
                          "--alpha applies only to --method smoothquant")
    assert_one_line_error(invoke("quantize", str(tiny), "-m", "rtn", "-o", out, "--group-size", "32",
                                 "--dtype", "bfloat16"), "--dtype applies only to --method smoothquant")
    assert not Path(out).exists()
