"""SmoothQuant on synthetic tensors and a tiny random model: folding the scales leaves the float model's
logits as they were, the scales follow their formula (tied per kv channel for o_proj), and they cut
W8A8's error on a linear whose input has an outlier channel, as the runtime kernel computes it."""

from __future__ import annotations

import pytest
import torch

from ruvllm.config import ModelConfig, QuantConfig
from ruvllm.models.registry import build_model
from ruvllm.quantize.awq import FOLD_ORDER, forward_logits
from ruvllm.quant.linear import QuantLinear
from ruvllm.quant.rtn import quantize_int8
from ruvllm.quantize.smoothquant import check_alpha, smooth_fold, smooth_scales, w8a8_mse

CFG = ModelConfig(architecture="llama", vocab_size=97, hidden_size=64, intermediate_size=128, num_layers=2,
                  num_heads=4, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-5, rope_theta=10000.0,
                  max_position_embeddings=64, tie_word_embeddings=False, attention_bias=True)


def _random_weights(cfg: ModelConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    """Hugging Face-named random tensors, with large-activation channels into every linear group."""
    g = torch.Generator().manual_seed(seed)

    def rand(*shape: int, scale: float = 0.1) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * scale

    h, inter, q, kv = cfg.hidden_size, cfg.intermediate_size, cfg.q_size, cfg.kv_size
    tensors = {"model.embed_tokens.weight": rand(cfg.vocab_size, h, scale=1.0),
               "model.norm.weight": 1.0 + rand(h), "lm_head.weight": rand(cfg.vocab_size, h, scale=2.0)}
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}"
        norms = {f"{p}.input_layernorm.weight": 1.0 + rand(h), f"{p}.post_attention_layernorm.weight": 1.0 + rand(h)}
        for t in norms.values():
            t[::9] *= 12.0  # outliers into q/k/v and gate/up
        v = rand(kv, h)
        v[:5] *= 8.0  # ... into o_proj
        up = rand(inter, h)
        up[::7] *= 8.0  # ... into down_proj
        tensors.update(norms)
        tensors.update({f"{p}.self_attn.q_proj.weight": rand(q, h), f"{p}.self_attn.k_proj.weight": rand(kv, h),
                        f"{p}.self_attn.v_proj.weight": v, f"{p}.self_attn.o_proj.weight": rand(h, q),
                        f"{p}.self_attn.q_proj.bias": rand(q), f"{p}.self_attn.k_proj.bias": rand(kv),
                        f"{p}.self_attn.v_proj.bias": rand(kv), f"{p}.mlp.gate_proj.weight": rand(inter, h),
                        f"{p}.mlp.up_proj.weight": up, f"{p}.mlp.down_proj.weight": rand(h, inter)})
    return tensors


def _tiny_model() -> torch.nn.Module:
    return build_model(CFG, _random_weights(CFG).items(), "tiny", CFG.max_position_embeddings, torch.float32,
                       quant=QuantConfig("none"))


def _ids(samples: int, length: int, seed: int) -> torch.Tensor:
    return torch.randint(0, CFG.vocab_size, (samples, length), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("alpha", [0.3, 0.5, 0.8])
def test_smoothing_keeps_the_float_model(alpha: float) -> None:
    model = _tiny_model()
    probe = _ids(2, 32, seed=1)
    before = forward_logits(model, probe)
    params = {name: p.clone() for name, p in model.named_parameters()}
    results = smooth_fold(model, _ids(4, 32, seed=2), alpha)
    assert [(r.layer, r.group) for r in results] == [(i, g) for i in range(CFG.num_layers) for g in FOLD_ORDER]
    # Every producer and consumer moved (norms, v rows and bias, up rows; all four linears) ...
    changed = {name for name, p in model.named_parameters() if not torch.equal(p, params[name])}
    for i in range(CFG.num_layers):
        assert {f"layers.{i}.{n}" for n in ("input_layernorm.weight", "post_attention_layernorm.weight",
                                             "qkv_proj.weight", "qkv_proj.bias", "o_proj.weight",
                                             "gate_up_proj.weight", "down_proj.weight")} <= changed
    # ... but only v's bias rows, and nothing outside the layers.
    assert not changed & {"embed_tokens.weight", "norm.weight", "lm_head.weight"}
    q_and_k = slice(0, CFG.q_size + CFG.kv_size)
    assert torch.equal(model.layers[0].qkv_proj.bias[q_and_k], params["layers.0.qkv_proj.bias"][q_and_k])
    after = forward_logits(model, probe)
    assert (after - before).abs().max().item() < 1e-4 * before.abs().max().item()


def test_only_the_named_groups_are_smoothed() -> None:
    model = _tiny_model()
    o_proj, gate_up = model.layers[1].o_proj.weight.clone(), model.layers[1].gate_up_proj.weight.clone()
    results = smooth_fold(model, _ids(2, 32, seed=3), 0.5, groups=("qkv_proj", "gate_up_proj"))
    assert {r.group for r in results} == {"qkv_proj", "gate_up_proj"}
    assert torch.equal(model.layers[1].o_proj.weight, o_proj)
    assert not torch.equal(model.layers[1].gate_up_proj.weight, gate_up)
    with pytest.raises(ValueError, match="unknown groups"):
        smooth_fold(model, _ids(1, 8, seed=3), 0.5, groups=("lm_head",))


def test_scales_follow_the_formula_and_tie_per_kv_channel() -> None:
    torch.manual_seed(0)
    w, a = torch.randn(8, 48), torch.rand(48) * 10
    a[3] = 0.0  # a channel that never fired keeps s = 1
    s = smooth_scales(a, w, 0.4)
    expected = a.pow(0.4) / w.abs().amax(dim=0).pow(0.6)
    assert s[3] == 1.0
    keep = torch.arange(48) != 3
    torch.testing.assert_close(s[keep], expected[keep])
    tie = (2, 3, 8)  # 2 kv heads, 3 query heads each, head_dim 8
    tied = smooth_scales(a, w, 0.4, tie=tie).view(tie)
    assert torch.equal(tied, tied[:, :1].expand(tie))
    a_kv, w_kv = a.view(tie).amax(dim=1), w.abs().amax(dim=0).view(tie).amax(dim=1)
    torch.testing.assert_close(tied[:, 0], a_kv.pow(0.4) / w_kv.pow(0.6))


def _w8a8_runtime_error(x: torch.Tensor, w: torch.Tensor) -> float:
    y = QuantLinear(quantize_int8(w), int8_activations=True)(x)
    return (y.double() - x.double() @ w.double().t()).pow(2).mean().item()


def test_smoothing_cuts_w8a8_error_on_an_outlier_channel() -> None:
    torch.manual_seed(1)
    w, x = torch.randn(96, 256) * 0.05, torch.randn(512, 256)
    x[:, 17] *= 60.0  # one channel sets every row's int8 scale
    s = smooth_scales(x.abs().amax(dim=0), w, 0.5)
    plain, smoothed = _w8a8_runtime_error(x, w), _w8a8_runtime_error(x / s, w * s)
    assert smoothed < 0.5 * plain, (smoothed, plain)
    # The estimate the command reports is the runtime kernel's error.
    assert w8a8_mse(x, w) == pytest.approx(plain, rel=1e-3)
    assert w8a8_mse(x / s, w * s) == pytest.approx(smoothed, rel=1e-3)


@pytest.mark.parametrize("alpha", [0.0, 1.0, -0.5, 1.5])
def test_alpha_outside_the_open_unit_interval_is_refused(alpha: float) -> None:
    with pytest.raises(ValueError, match="--alpha must be between 0 and 1"):
        check_alpha(alpha)
