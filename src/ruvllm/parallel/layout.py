"""Which slice of the model a rank holds (pure arithmetic, no processes or tensors).

Rank r of N holds, of every layer: query heads [r*H/N, (r+1)*H/N) and their rows of q_proj and
columns of o_proj; the KV heads those queries read (KV/N of them when N divides the KV heads; when
the KV heads are fewer than the ranks, the one KV head its queries share, so N/KV ranks hold a copy
of each); I/N of the MLP's intermediate columns (rows of gate and up, columns of down). Of the
vocabulary it holds ceil(V/N) rows of the embedding and of the LM head, the last rank's padded with
zero rows where N does not divide V. Norms and RoPE tables are whole on every rank.

A model fits N ranks when N divides its heads and its MLP width, and the KV heads split evenly or
replicate evenly (N divides them, or they divide N): otherwise some rank's queries would straddle
two KV heads, or a rank would hold a different shape than the others. Padding heads with zero
heads would make every rank compute and hold more than its share, for models whose sizes rarely
need it, so such sizes are refused, naming the sizes that fit.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ruvllm.config import ModelConfig


def layout_problems(cfg: ModelConfig, size: int) -> list[str]:
    """Why `size` ranks cannot split this model, one phrase each (empty: they can)."""
    problems = []
    if cfg.num_heads % size:
        problems.append(f"its {cfg.num_heads} attention heads do not split evenly across {size} ranks")
    kv = cfg.num_kv_heads
    if kv % size and size % kv:
        problems.append(f"its {kv} KV heads neither split evenly across {size} ranks nor replicate evenly "
                        f"({size} is not a multiple of {kv})")
    if cfg.intermediate_size % size:
        problems.append(f"its MLP width {cfg.intermediate_size} does not split evenly across {size} ranks")
    return problems


def fitting_sizes(cfg: ModelConfig) -> list[int]:
    """Every rank count that splits this model (1 included), up to its head count."""
    return [n for n in range(1, cfg.num_heads + 1) if not layout_problems(cfg, n)]


def layout_refusal(cfg: ModelConfig, size: int, model: str) -> str | None:
    """Why `size` ranks cannot split the model, with the sizes that can, as one phrase (None: they can)."""
    problems = layout_problems(cfg, size)
    if not problems:
        return None
    sizes = ", ".join(map(str, fitting_sizes(cfg)))
    return f"cannot split {model}: {'; '.join(problems)} (sizes that fit this model: {sizes})"


def check_layout(cfg: ModelConfig, size: int, model: str) -> None:
    """ValueError in one line when `size` ranks cannot split the model, with the sizes that can."""
    refusal = layout_refusal(cfg, size, model)
    if refusal is not None:
        raise ValueError(f"tensor_parallel_size {size} {refusal}")


@dataclass(frozen=True)
class ShardLayout:
    """Rank `rank` of `size`'s slice of a model whose whole shape is `model` (checked by check_layout)."""

    model: ModelConfig
    size: int
    rank: int

    @property
    def heads(self) -> int:
        return self.model.num_heads // self.size

    @property
    def kv_replicated(self) -> bool:
        return self.model.num_kv_heads < self.size

    @property
    def kv_heads(self) -> int:
        return 1 if self.kv_replicated else self.model.num_kv_heads // self.size

    @property
    def first_head(self) -> int:
        return self.rank * self.heads

    @property
    def first_kv_head(self) -> int:
        # Replicated: the KV head of this rank's queries (ranks r*KV//N share one); split: its own run.
        if self.kv_replicated:
            return self.rank * self.model.num_kv_heads // self.size
        return self.rank * self.kv_heads

    @property
    def intermediate(self) -> int:
        return self.model.intermediate_size // self.size

    @property
    def vocab_rows(self) -> int:
        """Rows of the embedding and LM head per rank (the padded vocabulary / N)."""
        return -(-self.model.vocab_size // self.size)

    @property
    def vocab_start(self) -> int:
        return self.rank * self.vocab_rows

    def local_config(self) -> ModelConfig:
        """The model's config as one rank's layers see it: their heads, MLP columns and vocabulary rows."""
        return dataclasses.replace(self.model, num_heads=self.heads, num_kv_heads=self.kv_heads,
                                   intermediate_size=self.intermediate, vocab_size=self.vocab_rows)
