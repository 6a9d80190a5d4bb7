"""One rank's model and runner, built the same way on every rank.

`RankSpec` is everything a rank needs, the same on every rank but its number and device; rank 0
makes them and pickles them to the other ranks' processes. Each rank builds its slice of the model
(`build_shard_model`); rank 0 runs it in a `LeaderRunner`, the engine's ModelRunner that announces
each model call before making it, and the others in a `FollowerRunner`, which makes the calls it is
told. Only rank 0 samples: the others' logits, all-gathered for rank 0, are dropped.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from ruvllm.config import ModelConfig, QuantConfig
from ruvllm.layers.ops import select_ops
from ruvllm.layers.rotary import RotaryEmbedding
from ruvllm.models.weight_plan import float_weight_plan
from ruvllm.parallel.group import RankGroup
from ruvllm.parallel.layers import TensorParallelLlama
from ruvllm.parallel.layout import ShardLayout
from ruvllm.parallel.sharding import Weights, shard_weights
from ruvllm.parallel.step_inputs import Allocate, CommandSender, Forward, Logits, Stop, receive
from ruvllm.worker.model_runner import ModelRunner


@dataclass(frozen=True)
class RankSpec:
    model: ModelConfig  # the whole model's shape
    weights: Weights  # Hugging Face-named float tensors for a dtype (it must pickle)
    source: str  # the model's path or name, for messages
    size: int
    rank: int
    device: str  # this rank's: "cpu", or "cuda:N" (rank 0's GPU + rank)
    dtype: torch.dtype
    quant: QuantConfig  # as the device takes it; dense forms only (support.py)
    max_model_len: int
    block_size: int
    attention: str
    seed: int
    threads: int
    rendezvous: Path

    @property
    def layout(self) -> ShardLayout:
        return ShardLayout(self.model, self.size, self.rank)


def build_shard_model(spec: RankSpec, group: RankGroup) -> TensorParallelLlama:
    """This rank's slice of the model, each tensor sliced as it is read."""
    layout, device = spec.layout, torch.device(spec.device)
    local = layout.local_config()
    # The local shapes' plan: every weight dense (support.py refused the rest), named as the model names them.
    plan = float_weight_plan(local, spec.quant, spec.dtype, device, spec.source)
    mc = spec.model
    rope = RotaryEmbedding(mc.head_dim, spec.max_model_len, mc.rope_theta, mc.rope_scaling, spec.dtype, device)
    with torch.device("meta"):  # no memory for initial weights; loading fills them
        model = TensorParallelLlama(layout, group, rope, select_ops(device))
    model.load_weights(shard_weights(spec.weights(spec.dtype), layout), plan, device)
    return model.eval()


class LeaderRunner(ModelRunner):
    """Rank 0's runner: every model call (a forward pass, logits of its rows, a new KV pool) is
    announced to the other ranks first, so they make the same call and meet it in its collectives.

    A call that fails between its announcement and its last collective (an error, Ctrl-C) leaves
    the other ranks inside it: the ranks are out of step, and every later call is refused rather
    than run against collectives that no longer match. (A failure elsewhere, in sampling say, leaves
    them in step.)"""

    def __init__(self, *args: object, commands: CommandSender, rank_failure: Callable[[], str | None],
                 on_out_of_step: Callable[[], None], **kwargs: object) -> None:
        self.commands = commands  # before ModelRunner's __init__, which allocates the pool
        self.rank_failure, self.on_out_of_step = rank_failure, on_out_of_step
        self.out_of_step: str | None = None
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]

    @contextlib.contextmanager
    def _announced(self) -> Iterator[None]:
        if self.out_of_step is not None:
            raise RuntimeError(f"the tensor-parallel ranks are out of step since a call failed ({self.out_of_step}); "
                               "load the engine again")
        try:
            yield
        except BaseException as exc:
            self.out_of_step = f"{type(exc).__name__}: {exc}"
            self.on_out_of_step()
            gone = self.rank_failure() if isinstance(exc, RuntimeError) else None
            if gone is not None:  # gloo's "connection closed by peer": say which rank is gone
                raise RuntimeError(f"{gone}; the step failed ({exc})") from exc
            raise

    def allocate_kv_cache(self, num_blocks: int, num_cold_blocks: int = 0) -> None:
        with self._announced():
            self.commands.allocate(num_blocks)
            super().allocate_kv_cache(num_blocks, num_cold_blocks)

    def run_tokens(self, input_ids: list[int], positions: list[int], seqs: list[tuple[int, int, list[int]]],
                   lora: object = None, scheduled: object = None) -> torch.Tensor:
        with self._announced():
            self.commands.forward(input_ids, seqs)
            return super().run_tokens(input_ids, positions, seqs, lora, scheduled)  # type: ignore[arg-type]

    def _logits(self, hidden: torch.Tensor, rows: list[int]) -> torch.Tensor:
        with self._announced():
            self.commands.logits(None if len(rows) == hidden.shape[0] else rows)
            return super()._logits(hidden, rows)


class FollowerRunner(ModelRunner):
    """A rank other than 0: makes the model calls rank 0 announces, until told to stop."""

    def follow(self, group: RankGroup) -> None:
        hidden: torch.Tensor | None = None
        with torch.inference_mode():
            while True:
                cmd = receive(group)
                if isinstance(cmd, Forward):
                    hidden = self.run_tokens(cmd.input_ids, cmd.positions, cmd.seqs)
                elif isinstance(cmd, Logits):
                    assert hidden is not None, "logits announced before any forward pass"
                    self._logits(hidden, list(range(hidden.shape[0])) if cmd.rows is None else cmd.rows)
                elif isinstance(cmd, Allocate):
                    hidden = None  # (its K/V were in the pool being replaced)
                    self.allocate_kv_cache(cmd.num_blocks)
                elif isinstance(cmd, Stop):
                    return
