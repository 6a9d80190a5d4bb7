"""The sharded Llama-family model: one rank's slice of every layer, and where the ranks meet.

Built on a rank's local config (layout.py: its heads, MLP columns and vocabulary rows), the Llama
model's own layers already are the column-parallel half: qkv_proj and gate_up_proj hold this rank's
output rows and need no communication, and attention runs on this rank's heads alone (the same
kernels, fewer heads). What this module adds is the other half, where the ranks meet:

- o_proj and down_proj are row-parallel: each rank multiplies its slice of the inputs by its
  columns of the weight, and an all-reduce sums the partial products: two all-reduces per layer
  of [tokens, hidden_size], after which every rank holds the whole residual stream again;
- the embedding is vocabulary-parallel: a rank looks up the ids in its rows, zeros for the others,
  and an all-reduce sums them (each id is in exactly one rank's rows);
- the LM head is vocabulary-parallel: each rank computes its rows' logits and an all-gather joins
  them (the padded rows of the last rank cut off).

The layer loop itself is LlamaForCausalLM's Python loop; the C++ whole-layer loop is never taken
(it would skip the all-reduces).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ruvllm.config import ModelConfig
from ruvllm.layers.dense import DenseLinear, dense_linear
from ruvllm.layers.ops import LayerOps
from ruvllm.layers.rotary import RotaryEmbedding
from ruvllm.models.cpu_layer_loop import CpuLayerLoop
from ruvllm.models.llama import LlamaForCausalLM
from ruvllm.parallel.group import RankGroup
from ruvllm.parallel.layout import ShardLayout


class RowParallelLinear(DenseLinear):
    """A linear whose input features are split across the ranks: partial products, summed."""

    def __init__(self, in_features: int, out_features: int, group: RankGroup, bias: bool = False) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.group.all_reduce(dense_linear(x, self.weight))
        return y if self.bias is None else y + self.bias  # once, after the sum


class VocabParallelEmbedding(nn.Module):
    """This rank's rows [start, start + rows) of the embedding table; lookups summed over the ranks."""

    def __init__(self, rows: int, dim: int, start: int, group: RankGroup) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(rows, dim))
        self.start, self.group = start, group

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        outside = (local < 0) | (local >= self.weight.shape[0])
        x = F.embedding(local.masked_fill(outside, 0), self.weight)
        x.masked_fill_(outside.unsqueeze(-1), 0.0)
        return self.group.all_reduce(x)


class TensorParallelLlama(LlamaForCausalLM):
    """LlamaForCausalLM on one rank's slice (the module's docstring)."""

    def __init__(self, layout: ShardLayout, group: RankGroup, rope: RotaryEmbedding, ops: LayerOps | None = None
                 ) -> None:
        local: ModelConfig = layout.local_config()
        super().__init__(local, rope, ops)
        self.vocab_size = layout.model.vocab_size  # the whole vocabulary, which compute_logits returns
        self.group = group
        self.embed_tokens = VocabParallelEmbedding(local.vocab_size, local.hidden_size, layout.vocab_start, group)
        for layer in self.layers:
            layer.o_proj = RowParallelLinear(local.q_size, local.hidden_size, group)
            layer.down_proj = RowParallelLinear(local.intermediate_size, local.hidden_size, group)

    def _layer_loop(self) -> CpuLayerLoop | None:
        return None

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.group.gather_columns(super().compute_logits(hidden))[:, :self.vocab_size]
