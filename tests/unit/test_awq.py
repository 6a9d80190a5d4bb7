"""AWQ pieces on synthetic tensors: the checkpoint-form int4 quantizer, AWQ packing (against the
independent packer of the checkpoint tests), the scale search, calibration blocks, shape checks."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ruvllm.config import ModelConfig
from ruvllm.quantize.awq import calibration_ids, clip_weight, fake_quantize, output_mse, search_scale
from ruvllm.quantize.awq_writer import check_awq_shapes
from ruvllm.quant.checkpoint_scheme import CheckpointQuant
from ruvllm.quant.checkpoints import awq_pack, awq_parts, awq_unpack, to_quantized
from ruvllm.quant.rtn import quantize_int4_checkpoint
from tests.e2e.test_checkpoint_quant import AWQ_ORDER, _pack


def _half_step_excess(qw, w: torch.Tensor) -> torch.Tensor:
    n, k = w.shape
    err = (qw.dequantize() - w).abs().reshape(n, k // qw.group_size, qw.group_size)
    return err.amax(dim=-1) / (qw.scales / 2)


@pytest.mark.parametrize("group_size", [32, 64, 128])
@pytest.mark.parametrize("offset", [0.0, 0.3, -2.0])
def test_checkpoint_int4_integer_zero_points_within_half_step(group_size: int, offset: float) -> None:
    torch.manual_seed(group_size)
    w = offset + torch.randn(24, 256) * torch.rand(24, 1)
    w[3] = 0.0  # an all-zero row
    qw = quantize_int4_checkpoint(w, group_size)
    z = 8.0 - qw.zeros / qw.scales
    assert torch.equal(z, z.round()) and z.min() >= 0 and z.max() <= 15  # whole steps: the file's zero points
    assert torch.equal(qw.scales.bfloat16().float(), qw.scales)  # what our kernels read ...
    assert torch.equal(qw.scales.half().float(), qw.scales)  # ... and what the file stores (fp16)
    assert float(_half_step_excess(qw, w).max()) <= 1 + 1e-5  # groups off zero included
    assert torch.equal(qw.dequantize()[3], torch.zeros(256))


def test_awq_pack_matches_the_independent_packer_and_round_trips() -> None:
    rng = np.random.default_rng(0)
    values = rng.integers(0, 16, size=(6, 48))
    ours = awq_pack(torch.from_numpy(values))
    theirs = _pack(values.reshape(6, 6, 8)[:, :, np.array(AWQ_ORDER)])
    assert ours.dtype == torch.int32 and np.array_equal(ours.numpy(), theirs)
    assert torch.equal(awq_unpack(ours), torch.from_numpy(values).to(torch.int32))
    with pytest.raises(ValueError, match="multiple of 8"):
        awq_pack(torch.zeros(2, 12, dtype=torch.int32))


def test_awq_parts_read_back_exactly() -> None:
    torch.manual_seed(0)
    w = torch.randn(48, 128) * 0.05
    qw = quantize_int4_checkpoint(w, 32)
    parts = awq_parts(qw)
    assert parts["qweight"].shape == (128, 6) and parts["qzeros"].shape == (4, 6)
    assert parts["scales"].shape == (4, 48) and parts["scales"].dtype == torch.float16
    back = to_quantized(CheckpointQuant("awq", 32, 0), parts, "w")
    assert torch.equal(back.codes, qw.codes) and torch.equal(back.dequantize(), qw.dequantize())
    with pytest.raises(ValueError, match="zero points"):  # the runtime RTN's zero points are not whole steps
        from ruvllm.quant.rtn import quantize_int4
        awq_parts(quantize_int4(w + 0.3, 32))


def _outlier_inputs(t: int, k: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, k, generator=g)
    x[:, :: k // 8] *= 20.0  # a few channels carry much larger activations, as in LLMs
    return x


def test_search_never_worse_than_rtn_and_its_loss_is_the_direct_one() -> None:
    torch.manual_seed(1)
    w, x = torch.randn(64, 128) * 0.02, _outlier_inputs(256, 128)
    found = search_scale(w, x, x.abs().mean(dim=0), 32)
    assert found.loss <= found.rtn_loss
    assert found.loss < 0.8 * found.rtn_loss and found.alpha > 0  # the outliers make scaling pay
    # The loss is what it says: X W^T against (X / s) Q(W s)^T.
    s = found.scales
    direct = ((x / s) @ fake_quantize(w * s, 32).t() - x @ w.t()).pow(2).mean().item()
    assert direct == pytest.approx(found.loss, rel=1e-3)
    rtn = output_mse(x, w, fake_quantize(w, 32))
    assert found.rtn_loss == rtn
    # grid 0 is RTN alone: scales of one.
    plain = search_scale(w, x, x.abs().mean(dim=0), 32, grid=0)
    assert plain.alpha == 0 and torch.equal(plain.scales, torch.ones(128)) and plain.loss == rtn


def test_search_ties_scales_across_query_heads_of_one_kv_head() -> None:
    torch.manual_seed(2)
    kv, rep, dim = 2, 3, 16
    w, x = torch.randn(32, kv * rep * dim) * 0.02, _outlier_inputs(128, kv * rep * dim)
    found = search_scale(w, x, x.abs().mean(dim=0), 32, tie=(kv, rep, dim))
    per_head = found.scales.view(kv, rep, dim)
    assert torch.equal(per_head, per_head[:, :1].expand(kv, rep, dim))
    assert found.loss <= found.rtn_loss


def test_search_skips_scales_that_overflow_the_folded_producer() -> None:
    torch.manual_seed(3)
    w, x = torch.randn(32, 64) * 0.02, _outlier_inputs(128, 64)
    free = search_scale(w, x, x.abs().mean(dim=0), 32)
    assert free.alpha > 0
    # A producer already near fp16's limit: any scale below 1 would overflow it when divided.
    capped = search_scale(w, x, x.abs().mean(dim=0), 32, producer_absmax=torch.full((64,), 5.9e4))
    assert capped.alpha == 0 and capped.loss == capped.rtn_loss


def _group_errors(x: torch.Tensor, w: torch.Tensor, wq: torch.Tensor, g: int) -> torch.Tensor:
    """[N, G]: sum over rows of x of (x_group . (wq - w)_group)^2, each output row and input group."""
    n, k = w.shape
    xg = x.view(-1, k // g, g)
    dw = (wq - w).view(n, k // g, g)
    return torch.einsum("tgi,ngi->tng", xg, dw).pow(2).sum(dim=0)


def test_clip_never_raises_a_groups_error_and_tames_outlier_weights() -> None:
    torch.manual_seed(4)
    w, x = torch.randn(32, 128) * 0.02, torch.randn(256, 128)
    w[::5, 7] = 0.5  # single large weights stretch their groups' grids
    clipped = clip_weight(w, x, 32)
    assert torch.all(clipped.abs() <= w.abs())  # only ever shrinks towards zero
    before = _group_errors(x, w, fake_quantize(w, 32), 32)
    after = _group_errors(x, w, fake_quantize(clipped, 32), 32)
    assert torch.all(after <= before * (1 + 1e-5))
    assert after.sum() < before.sum()
    assert torch.equal(clip_weight(w, x, 32, ratios=(1.0,)), w)


def test_calibration_blocks() -> None:
    ids = list(range(1000))
    blocks = calibration_ids(ids, 4, 100)
    assert blocks.shape == (4, 100)
    assert blocks[:, 0].tolist() == [0, 200, 500, 700]  # spread over the 10 whole blocks
    assert calibration_ids(ids, 50, 100).shape == (10, 100)  # as many as the text holds
    assert calibration_ids(ids[:30], 4, 100).shape == (1, 30)  # shorter than one block: all of it
    with pytest.raises(ValueError, match="fewer than 2 tokens"):
        calibration_ids([5], 4, 100)


def _cfg(hidden: int, inter: int, heads: int = 9, kv: int = 3) -> ModelConfig:
    return ModelConfig(architecture="llama", vocab_size=100, hidden_size=hidden, intermediate_size=inter,
                       num_layers=1, num_heads=heads, num_kv_heads=kv, head_dim=hidden // heads,
                       rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=64,
                       tie_word_embeddings=True)


def test_shape_checks_name_the_layers_and_the_sizes_that_fit() -> None:
    check_awq_shapes(_cfg(576, 1536), 64)
    with pytest.raises(ValueError, match=r"group size 128 does not divide the input size 576 of q_proj.*"
                                         r"group sizes that fit this model: 32, 64"):
        check_awq_shapes(_cfg(576, 1536), 128)
    with pytest.raises(ValueError, match="--group-size must be one of 32, 64, 128, 256"):
        check_awq_shapes(_cfg(576, 1536), 48)
    with pytest.raises(ValueError, match="output size 4 of k_proj and v_proj is not a multiple of 8"):
        check_awq_shapes(_cfg(64, 128, heads=16, kv=1), 32)  # head_dim 4, one kv head
