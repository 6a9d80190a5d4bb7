"""`ruvllm quantize` and the AWQ search on a tiny random Llama made here (with a few large-activation
channels, as real models have): the folded float model computes what it did, the search beats
round-to-nearest on the calibration activations, the written checkpoint reads back exactly and runs
in the engine, and bad input is one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import LlamaConfig, LlamaForCausalLM
from typer.testing import CliRunner, Result

from ruvllm import LLM, SamplingParams
from ruvllm.cli.main import _register, app
from ruvllm.loader import iter_weights, load_tokenizer, resolve_model
from ruvllm.quantize.awq import awq_fold, calibration_ids, fake_quantize, forward_logits
from ruvllm.quantize.awq_writer import load_float_model, quantization_config, write_awq_folder
from ruvllm.quant.linear import QuantLinear
from ruvllm.quant.weights import QuantizedWeight
from tests.conftest import novel_prompts
from tests.reference import hf_logits, hf_reference
from tests.unit.test_cli_models import assert_one_line_error

if not any(c.name == "quantize" for c in app.registered_commands):
    _register()
runner = CliRunner()
GROUP = 32
PROJ = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


pytestmark = pytest.mark.usefixtures("wide_terminal")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random Llama (GQA, untied LM head) with the default model's tokenizer and vocabulary."""
    folder = tmp_path_factory.mktemp("tiny-llama")
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False, bos_token_id=1,
        eos_token_id=2))
    with torch.no_grad():
        model.lm_head.weight.mul_(20.0)  # random init gives tiny logits
        for layer in model.model.layers:  # large-activation channels into q/k/v and gate/up
            for norm in (layer.input_layernorm, layer.post_attention_layernorm):
                norm.weight[::9] *= 12.0
            layer.self_attn.v_proj.weight[:5] *= 8.0  # ... into o_proj
            layer.mlp.up_proj.weight[::7] *= 8.0  # ... into down_proj
    model.save_pretrained(folder)
    load_tokenizer(resolve_model(None)).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def calibration(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("calib") / "calibration.txt"
    path.write_text("\n\n".join(novel_prompts(40, words=120)), encoding="utf-8")
    return path


def _ids(tiny: Path, calibration: Path, samples: int = 4, seq_len: int = 64) -> torch.Tensor:
    tok = load_tokenizer(resolve_model(tiny))
    return calibration_ids(tok.encode(calibration.read_text(), add_special_tokens=False), samples, seq_len)


def test_calibration_forward_matches_transformers(tiny: Path, calibration: Path) -> None:
    src = resolve_model(tiny)
    model, _, _ = load_float_model(src, 64)
    ids = _ids(tiny, calibration, samples=2)
    ours = forward_logits(model, ids)
    ref = hf_reference(src)
    for row, theirs in zip(ours, (hf_logits(ref, r.tolist()) for r in ids)):
        assert (row - theirs).abs().max().item() < 1e-4


def test_folding_keeps_the_float_model_and_beats_rtn(tiny: Path, calibration: Path) -> None:
    model, _, _ = load_float_model(resolve_model(tiny), 64)
    ids = _ids(tiny, calibration)
    probe = ids[:2]
    before = forward_logits(model, probe)
    norms = [layer.input_layernorm.weight.clone() for layer in model.layers]
    results = awq_fold(model, ids, GROUP, clip=False)
    assert len(results) == 4 * len(model.layers) and not any(r.clipped for r in results)
    # Folding moved real scales into the norms, yet the float model computes the same logits.
    assert any(not torch.equal(n, layer.input_layernorm.weight) for n, layer in zip(norms, model.layers))
    after = forward_logits(model, probe)
    assert (after - before).abs().max().item() < 1e-4
    # The search includes alpha = 0 (plain round-to-nearest): never worse on the calibration inputs,
    # and clearly better where activations have outliers.
    for r in results:
        assert r.loss <= r.rtn_loss, r
    assert sum(r.loss / r.rtn_loss for r in results) / len(results) < 0.9
    assert any(r.alpha > 0 for r in results)


def test_clipping_only_lowers_the_error(tiny: Path, calibration: Path) -> None:
    ids = _ids(tiny, calibration)
    scaled, _, _ = load_float_model(resolve_model(tiny), 64)
    plain = awq_fold(scaled, ids, GROUP, clip=False)
    model, _, _ = load_float_model(resolve_model(tiny), 64)
    clipped = awq_fold(model, ids, GROUP, clip=True)
    # Clipping comes after each group's fold and is kept only where it lowers the group's error.
    for p, c in zip(plain, clipped):
        assert (c.layer, c.group, c.alpha) == (p.layer, p.group, p.alpha)
        assert c.loss <= p.loss <= c.rtn_loss, (p, c)
        if c.clipped:
            assert c.loss < p.loss
    assert any(c.clipped for c in clipped)
    # q and k rows are never clipped: the folded weights there are the scaled-only ones.
    cfg = model.cfg
    for a, b in zip(scaled.layers, model.layers):
        assert torch.equal(a.qkv_proj.weight[:cfg.q_size + cfg.kv_size], b.qkv_proj.weight[:cfg.q_size + cfg.kv_size])


def test_written_checkpoint_reads_back_exactly(tiny: Path, calibration: Path, tmp_path: Path) -> None:
    src = resolve_model(tiny)
    model, _, names = load_float_model(src, 64)
    awq_fold(model, _ids(tiny, calibration, samples=2), GROUP)
    out = tmp_path / "awq"
    write_awq_folder(src, model, names, out, GROUP)
    config = json.loads((out / "config.json").read_text())
    assert config["quantization_config"] == {"quant_method": "awq", "bits": 4, "group_size": GROUP,
                                             "zero_point": True, "version": "gemm"} == quantization_config(GROUP)
    assert {"generation_config.json", "tokenizer.json", "tokenizer_config.json"} <= {p.name for p in out.iterdir()}
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        stored = {name: f.get_tensor(name) for name in f.keys()}
    prefix = "model.layers.1.self_attn.k_proj"
    assert stored[f"{prefix}.qweight"].dtype == torch.int32 and stored[f"{prefix}.qweight"].shape == (64, 4)
    assert stored[f"{prefix}.qzeros"].shape == (2, 4) and stored[f"{prefix}.scales"].shape == (2, 32)
    assert stored[f"{prefix}.scales"].dtype == torch.float16 and f"{prefix}.weight" not in stored
    assert stored["model.embed_tokens.weight"].dtype == stored["lm_head.weight"].dtype == torch.float16
    # Read back by the loader: each projection is exactly the checkpoint RTN of the folded float weight,
    # everything else the folded float values in fp16.
    kept = dict(iter_weights(resolve_model(out), torch.float32, keep_quantized=True))
    folded = {n: t for n, t in _hf_named(model, names)}
    for name, value in kept.items():
        if name.rsplit(".", 2)[-2] in PROJ:
            assert isinstance(value, QuantizedWeight) and value.group_size == GROUP, name
            assert torch.equal(value.dequantize(), fake_quantize(folded[name], GROUP)), name
        else:
            assert torch.equal(value, folded[name].half().float()), name


def _hf_named(model: torch.nn.Module, names: list[str]):
    for name in names:
        pname, offset, rows = model.target(name.removeprefix("model."))
        value = model.get_parameter(pname).data
        yield name, value if offset is None else value[offset:offset + rows]


def invoke(*args: str) -> Result:
    return runner.invoke(app, list(args))


def test_cli_writes_a_checkpoint_that_loads_and_generates(tiny: Path, calibration: Path, tmp_path: Path) -> None:
    out = tmp_path / "q"
    result = invoke("quantize", str(tiny), "--method", "awq", "--calibration", str(calibration), "--output", str(out),
                    "--group-size", str(GROUP), "--samples", "4", "--seq-len", "64")
    assert result.exit_code == 0, result.output
    assert f"wrote {out} (awq int4, group size {GROUP}" in result.stdout
    llm = LLM(str(out), dtype="bfloat16", num_blocks=16)  # auto: the int4 codes stay packed
    assert isinstance(llm.model.layers[0].qkv_proj, QuantLinear)
    got = llm.generate(["It is a truth universally"], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert len(got[0].outputs[0].token_ids) == 4
    # An existing non-empty output is refused, and replaced with --force.
    again = ["quantize", str(tiny), "--method", "rtn", "-o", str(out), "--group-size", str(GROUP)]
    assert_one_line_error(invoke(*again), "exists and is not empty; pass --force")
    result = invoke(*again, "--force")
    assert result.exit_code == 0, result.output
    assert "wrote" in result.stdout and resolve_model(out).format == "hf"


def test_cli_bad_input_is_one_line(tiny: Path, calibration: Path, tmp_path: Path) -> None:
    out = str(tmp_path / "out")
    common = ["quantize", str(tiny), "-o", out, "--group-size", str(GROUP)]
    assert_one_line_error(invoke(*common, "--method", "gptq"), "unknown method 'gptq'; choose one of awq, rtn")
    assert_one_line_error(invoke(*common, "--calibration", str(tmp_path / "missing.txt")),
                           "missing.txt: calibration file not found")
    assert_one_line_error(invoke(*common), "--method awq needs --calibration FILE")
    assert_one_line_error(invoke("quantize", str(tiny), "-o", out, "-c", str(calibration)),  # default group 128
                           "group size 128 does not divide the input size 64", "group sizes that fit this model: 32, 64")
    assert_one_line_error(invoke(*common, "-c", str(calibration), "--samples", "0"), "--samples must be at least 1")
    assert_one_line_error(invoke("quantize", str(tiny), "-o", str(tiny), "--method", "rtn", "--group-size", "32",
                                  "--force"), "holds the model being quantized")
    assert not Path(out).exists()
