"""One decoder layer definition per family (models/llama.py, models/gemma3.py), run by every path: the
learner's autograd layers and AWQ/SmoothQuant calibration, on a tiny random Gemma 3 (sandwich and
(1 + w) norms, GeGLU, q/k norms, sliding layers with their own RoPE base and a window shorter than the
text, an attention scalar, a soft-cap) against transformers' Gemma 3 on the same weights. Folded
scales keep its float outputs, and a folded model written as a folder is what transformers reads."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from ruvllm.learning.config import InstantConfig
from ruvllm.learning.instant import InstantLearner
from ruvllm.learning.tail import LearnedLayers, hidden_before
from ruvllm.loader import resolve_model
from ruvllm.quantize.awq import awq_fold, forward_logits
from ruvllm.quantize.awq_writer import load_float_model, write_float_folder
from ruvllm.quantize.smoothquant import smooth_fold
from tests.reference import hf_reference

LAYER_TYPES = ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"]
IDS = torch.randint(3, 256, (2, 40), generator=torch.Generator().manual_seed(1))  # 40 tokens: 5 windows


def _tiny_gemma(folder: Path, softcap: float | None) -> Path:
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(0)
    model = Gemma3ForCausalLM(Gemma3TextConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, sliding_window=8, layer_types=LAYER_TYPES, query_pre_attn_scalar=24,
        final_logit_softcapping=softcap, max_position_embeddings=128))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):  # w far from 0: a norm read as w, or as 1 + w twice, shows
                p.normal_(0.0, 0.3)
        for layer in model.model.layers:  # large-activation channels into q/k/v and gate/up, as AWQ meets
            layer.input_layernorm.weight[::7] += 6.0
            layer.pre_feedforward_layernorm.weight[::9] += 6.0
    model.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def capped(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _tiny_gemma(tmp_path_factory.mktemp("gemma3-capped"), 30.0)


@pytest.fixture(scope="module")
def uncapped(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """As Gemma 3 ships: no final soft-cap (the learner's logits are the head's product)."""
    return _tiny_gemma(tmp_path_factory.mktemp("gemma3"), None)


def _theirs(folder: Path, ids: torch.Tensor = IDS) -> torch.Tensor:
    with torch.no_grad():
        return hf_reference(resolve_model(folder))(ids).logits.float()


def test_calibration_forward_is_transformers(capped: Path) -> None:
    model, cfg, _ = load_float_model(resolve_model(capped), 64)
    assert cfg.sliding_layers == (0, 1, 3) and cfg.sliding_window == 8 and cfg.final_logit_softcapping == 30.0
    assert (forward_logits(model, IDS) - _theirs(capped)).abs().max() < 1e-4


@pytest.mark.parametrize("n", [1, 2])
def test_learned_layers_are_transformers(uncapped: Path, n: int) -> None:
    """Below the learned layers as inference, the last n (a global and a sliding one) in autograd:
    transformers' logits; the frozen-context form gives the same rows; a gradient step moves the
    micro-LoRA on every target."""
    model, _, _ = load_float_model(resolve_model(uncapped), 64)
    ids = IDS[0].tolist()
    expected = _theirs(uncapped, IDS[:1])[0]
    layers = LearnedLayers(model, n)
    out = layers.forward(hidden_before(model, ids, layers.first), torch.arange(len(ids)), None)
    assert (out @ layers.head.t() - expected).abs().max() < 1e-4
    learner = InstantLearner(layers, InstantConfig(layers=n, context="frozen", candidates=0))
    prompt, target = ids[:30], ids[30:]
    prep = learner.prepare(prompt, target)
    with torch.no_grad():
        rows = layers.forward(prep.h, torch.arange(29, 39), None, prep.context)
    assert (rows @ layers.head.t() - expected[29:39]).abs().max() < 1e-4
    state = learner.new_tenant(seed=0)
    before = [p.detach().clone() for p in state.lora.parameters()]
    assert learner.step(state, prep, 1.0).loss > 0
    assert all(not torch.equal(p, b) for p, b in zip(state.lora.parameters()[1::2], before[1::2]))  # every B


def test_folds_keep_the_model_and_the_written_folder_is_it(capped: Path, tmp_path: Path) -> None:
    """SmoothQuant's and AWQ's folds go into Gemma's own producers (the MLP's input is the
    pre-feedforward norm, held as 1 + w): the float model computes what it did, and written out (w,
    as the files hold it) transformers computes the same."""
    src = resolve_model(capped)
    model, _, names = load_float_model(src, 64)
    before = forward_logits(model, IDS)
    norm = model.layers[0].pre_feedforward_layernorm.weight.clone()
    smooth_fold(model, IDS, 0.5)
    awq_fold(model, IDS, group_size=32, grid=4, clip=False)
    assert not torch.equal(model.layers[0].pre_feedforward_layernorm.weight, norm)
    after = forward_logits(model, IDS)
    assert (after - before).abs().max() < 1e-4 * before.abs().max()
    write_float_folder(src, model, names, tmp_path / "folded", tokenizer=SimpleNamespace(save_pretrained=str))
    assert (_theirs(tmp_path / "folded") - after).abs().max() < 1e-4
