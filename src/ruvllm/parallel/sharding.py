"""A rank's slice of each Hugging Face-named tensor, as layout.py lays the model out.

Every rank reads the same files (or the same weights function) and keeps its own slice of each
tensor as it arrives, so no rank ever holds more than one whole tensor at a time and no weights
cross between processes. Slicing the Hugging Face tensors (before the model fuses q/k/v and gate/up)
keeps each fused piece's offsets the model's own: the sharded model fuses its slices the same way.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ruvllm.parallel.layout import ShardLayout

if TYPE_CHECKING:
    from ruvllm.loader import ModelSource

Weights = Callable[[torch.dtype], Iterable[tuple[str, torch.Tensor]]]


@dataclass(frozen=True)
class FileWeights:
    """A model's float weights read from its files (packed GGUF blocks dequantized): a weights
    function that pickles, so each rank's process reads the files itself."""

    source: ModelSource

    def __call__(self, dtype: torch.dtype) -> Iterable[tuple[str, torch.Tensor]]:
        from ruvllm.loader import iter_weights

        return iter_weights(self.source, dtype, keep_quantized=False)


def _slice(t: torch.Tensor, dim: int, start: int, length: int) -> torch.Tensor:
    # A copy, not a view: a view would keep the whole tensor's storage alive.
    return t.narrow(dim, start, length).clone(memory_format=torch.contiguous_format)


def shard_tensor(name: str, t: torch.Tensor, layout: ShardLayout) -> torch.Tensor:
    """This rank's slice of the tensor named `name` (with or without the "model." prefix)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: tensor parallelism shards float tensors, got {type(t).__name__}")
    parts = name.removeprefix("model.").split(".")
    d = layout.model.head_dim
    if parts[0] in ("embed_tokens", "lm_head"):
        rows = layout.vocab_rows
        real = max(0, min(rows, t.shape[0] - layout.vocab_start))
        piece = _slice(t, 0, layout.vocab_start, real)
        if real == rows:
            return piece
        return torch.cat([piece, piece.new_zeros(rows - real, *t.shape[1:])])  # the padded vocabulary
    if parts[0] != "layers" or len(parts) < 5:
        return t  # norms: whole on every rank
    proj, leaf = parts[3], parts[4]
    if proj == "q_proj":
        return _slice(t, 0, layout.first_head * d, layout.heads * d)
    if proj in ("k_proj", "v_proj"):
        return _slice(t, 0, layout.first_kv_head * d, layout.kv_heads * d)
    if proj in ("gate_proj", "up_proj"):
        return _slice(t, 0, layout.rank * layout.intermediate, layout.intermediate)
    if proj == "o_proj" and leaf == "weight":
        return _slice(t, 1, layout.first_head * d, layout.heads * d)
    if proj == "down_proj" and leaf == "weight":
        return _slice(t, 1, layout.rank * layout.intermediate, layout.intermediate)
    return t  # q/k norms (per head_dim), and a row-parallel bias (added once, after the sum)


def shard_weights(weights: Iterable[tuple[str, torch.Tensor]], layout: ShardLayout
                  ) -> Iterator[tuple[str, torch.Tensor]]:
    for name, t in weights:
        yield name, shard_tensor(name, t, layout)
