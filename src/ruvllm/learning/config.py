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
    # EWC++, applied by the background loop (learning/background.py): the penalty lambda * sum F
    # (theta - theta*)^2, theta* the micro-LoRA's starting point (the base model's behaviour) and F
    # an online diagonal Fisher of the LM loss on the tenant's own recent completions, refreshed
    # after `fisher_every` events (F <- gamma F + (1 - gamma) g^2). lambda 0: off.
    ewc_lambda: float = 3e6  # the default model's micro-LoRA Fisher is tiny (median 6e-9 a coordinate; docs/learning.md)
    fisher_every: int = 5
    fisher_samples: int = 4
    fisher_gamma: float = 0.5


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
    # The background loop consolidates each tenant's instant updates under EWC++ at most this often
    # (seconds) while there are any, on a thread of its own. None: no thread; call
    # Learner.consolidate() (the offline LLM, which is not thread-safe). `ruvllm serve` uses 0.1.
    background_s: float | None = None
    # The nice value of the threads that learn (the background loop's; the server's update thread):
    # on a machine with few cores, updates take what serving leaves. 0: as they are.
    nice: int = 0
    # Version folders kept per tenant (the serving one and every deep-loop promotion are kept too);
    # older ones are deleted with their policy-store rows. 0: keep all.
    keep_versions: int = 16
