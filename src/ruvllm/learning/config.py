"""Settings of learning from feedback (typed, torch-free: the server's config holds them)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class InstantConfig:
    layers: int = 4  # the last n decoder layers learn
    rank: int = 2
    alpha: float = 4.0
    targets: tuple[str, ...] = ("v_proj", "o_proj", "down_proj")
    lr: float = 1e-2
    context: str = "full"  # or "frozen" (learning/instant.py; measured in docs/learning.md)
    candidates: int = 2048  # sampled softmax size; 0: the whole vocabulary
    seed: int = 0


@dataclass(frozen=True)
class LearningConfig:
    instant: InstantConfig = field(default_factory=InstantConfig)
    store_count: int = 10_000  # completions kept for feedback
    store_age_s: float = 3600.0
    root: str | None = None  # where adapter versions are written (default: a data folder)
    # Threads of this process's PyTorch for the updates (None: as they are). `ruvllm serve` runs the
    # engine core in a process of its own and gives the learner 1, so that updates take one core
    # from serving, not every core.
    threads: int | None = None
