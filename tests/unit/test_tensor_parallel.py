"""Tensor parallelism's parts alone (ruvllm/parallel): which slice each rank holds, that the slices
put back together are the model, what sizes a model takes, rank 0's commands on the wire, and the
sharded model on a group of one rank against the plain model (gloo here; NCCL on a GPU)."""

from __future__ import annotations

import dataclasses
from collections import deque
from pathlib import Path

import pytest
import torch

from ruvllm.config import EngineConfig, QuantConfig
from ruvllm.engine.llm import build_engine_config
from ruvllm.cli.engine_options import engine_settings
from ruvllm.models.llama import LayerRun
from ruvllm.models.random_weights import random_weights
from ruvllm.models.registry import build_model
from ruvllm.parallel.group import join_group
from ruvllm.parallel.layout import ShardLayout, check_layout, fitting_sizes
from ruvllm.parallel.shard import RankSpec, build_shard_model
from ruvllm.parallel.sharding import shard_tensor
from ruvllm.parallel.step_inputs import Allocate, CommandSender, Forward, Logits, Stop, receive
from tests.engine_fixtures import TINY_GQA

SMOLLM2 = dataclasses.replace(TINY_GQA, vocab_size=49152, hidden_size=576, intermediate_size=1536, num_heads=9,
                              num_kv_heads=3, head_dim=64)


def test_layouts_split_heads_and_replicate_too_few_kv_heads() -> None:
    gqa = [ShardLayout(TINY_GQA, 2, r) for r in range(2)]  # 4 heads, 2 KV heads
    assert [(s.first_head, s.heads, s.first_kv_head, s.kv_heads) for s in gqa] == [(0, 2, 0, 1), (2, 2, 1, 1)]
    mqa = [ShardLayout(dataclasses.replace(TINY_GQA, num_kv_heads=1), 2, r) for r in range(2)]
    assert all(s.kv_replicated and (s.first_kv_head, s.kv_heads) == (0, 1) for s in mqa)
    wide = dataclasses.replace(TINY_GQA, num_heads=8, num_kv_heads=2)  # 4 ranks: two share each KV head
    assert [ShardLayout(wide, 4, r).first_kv_head for r in range(4)] == [0, 0, 1, 1]
    local = gqa[1].local_config()
    assert (local.num_heads, local.num_kv_heads, local.intermediate_size, local.vocab_size) == (2, 1, 128, 256)


def test_sizes_that_do_not_split_a_model_are_refused_naming_the_sizes_that_do() -> None:
    assert fitting_sizes(SMOLLM2) == [1, 3]  # 9 heads, 3 KV heads
    assert fitting_sizes(TINY_GQA) == [1, 2, 4]
    with pytest.raises(ValueError) as err:
        check_layout(SMOLLM2, 2, "SmolLM2")
    msg = str(err.value)
    assert "\n" not in msg and "9 attention heads" in msg and "3 KV heads" in msg
    assert "sizes that fit this model: 1, 3" in msg
    check_layout(SMOLLM2, 3, "SmolLM2")


@pytest.mark.parametrize("kv_heads, vocab", [(2, 512), (1, 509)])
def test_the_ranks_slices_put_back_together_are_the_model(kv_heads: int, vocab: int) -> None:
    cfg = dataclasses.replace(TINY_GQA, num_kv_heads=kv_heads, vocab_size=vocab, attention_bias=True)
    layouts = [ShardLayout(cfg, 2, r) for r in range(2)]
    for name, t in random_weights(cfg, torch.float32, "cpu"):
        pieces = [shard_tensor(name, t, lay) for lay in layouts]
        proj = name.split(".")[-2]
        if proj in ("k_proj", "v_proj") and kv_heads == 1:  # replicated: every rank holds it whole
            assert all(torch.equal(p, t) for p in pieces)
        elif proj in ("o_proj", "down_proj"):  # row-parallel: input columns split
            assert torch.equal(torch.cat(pieces, dim=1), t)
        elif proj in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "embed_tokens", "lm_head"):
            whole = torch.cat(pieces)
            assert torch.equal(whole[:vocab] if proj in ("embed_tokens", "lm_head") else whole, t)
            assert not whole[t.shape[0]:].any()  # the padded vocabulary rows are zero
        else:  # norms
            assert all(p is t for p in pieces)
        assert all(p.is_contiguous() for p in pieces)


class _Wire:
    """Broadcasts of one sender and one receiver in one process: what rank 0 sends, rank 1 gets."""

    rank, size = 0, 2

    def __init__(self) -> None:
        self.sent: deque[torch.Tensor] = deque()

    def broadcast(self, t: torch.Tensor) -> torch.Tensor:
        if self.rank == 0:
            self.sent.append(t.clone())
            return t
        src = self.sent.popleft()
        assert src.shape == t.shape
        return t.copy_(src)


def test_commands_arrive_as_sent_inline_and_beyond_the_header() -> None:
    wire = _Wire()
    send = CommandSender(wire)  # type: ignore[arg-type]
    small = ([5, 6, 7], [(2, 9, [0]), (1, 4, [3])])
    big = (list(range(300)), [(300, 310, list(range(20)))])
    send.forward(*small)
    send.forward(*big)
    send.logits(None)
    send.logits([4, 4, 2])
    send.allocate(77)
    send.stop()
    assert len(wire.sent) == 7  # one header each, and a second broadcast for the big forward
    wire.rank = 1
    got = [receive(wire) for _ in range(6)]  # type: ignore[arg-type]
    assert got == [Forward(*small), Forward(*big), Logits(None), Logits([4, 4, 2]), Allocate(77), Stop()]
    assert got[0].positions == [7, 8, 3] and got[1].positions == list(range(10, 310))


def _sharded_alone(tmp_path: Path, device: str) -> None:
    """The sharded model on a group of one rank (every collective a no-op over one rank, the same
    code as N ranks) computes the plain model's logits."""
    cfg = dataclasses.replace(TINY_GQA, vocab_size=509, tie_word_embeddings=True)
    dev = torch.device(device)
    weights = lambda dtype: random_weights(cfg, dtype, "cpu", std=0.1)  # noqa: E731
    spec = RankSpec(model=cfg, weights=weights, source="tiny", size=1, rank=0, device=device, dtype=torch.float32,
                    quant=QuantConfig("none"), max_model_len=64, block_size=16, attention="torch", seed=0,
                    threads=1, rendezvous=tmp_path / "rendezvous")
    group = join_group(spec.rendezvous, 0, 1, dev)
    try:
        sharded = build_shard_model(spec, group)
        plain = build_model(cfg, weights(torch.float32), "tiny", 64, torch.float32, dev,
                            quant=QuantConfig("none"))
        hidden = torch.randn(5, cfg.hidden_size, generator=torch.Generator().manual_seed(0)).to(dev)
        ids = torch.tensor([0, 3, 508, 200, 7], device=dev)
        with torch.inference_mode():
            assert torch.equal(sharded.embed_tokens(ids), plain.embed_tokens(ids))
            assert torch.equal(sharded.compute_logits(hidden), plain.compute_logits(hidden))
            run = LayerRun(plain.ops, attend=None)  # the MLP attends nothing
            assert torch.equal(sharded.layers[0].mlp(hidden, run), plain.layers[0].mlp(hidden, run))
    finally:
        group.close()


def test_the_sharded_model_on_one_gloo_rank_is_the_model(tmp_path: Path) -> None:
    _sharded_alone(tmp_path, "cpu")


@pytest.mark.skipif(not torch.cuda.is_available() or not torch.distributed.is_nccl_available(),
                    reason="NCCL needs a CUDA GPU (on one GPU only a group of one rank can be tested)")
def test_the_sharded_model_on_one_nccl_rank_is_the_model(tmp_path: Path) -> None:
    _sharded_alone(tmp_path, "cuda:0")


def test_the_setting_is_declared_once_for_the_cli_and_llm() -> None:
    assert build_engine_config(tensor_parallel_size=2).tensor_parallel_size == 2
    assert "tensor_parallel_size" in {s.name for s in engine_settings()}
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="tensor_parallel_size"):
            EngineConfig(tensor_parallel_size=bad)  # type: ignore[arg-type]
