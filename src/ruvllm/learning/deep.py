"""The deep loop (`ruvllm learn run`): a real LoRA fine-tune over the pattern bank's best example per
cluster, with EWC++ against the base, promoted to a new adapter version only when held-out checks
pass. It runs in a process of its own (the CLI), at low priority; a running server serves a promoted
version at its next request (the policy store's change).

The checks, all on the learner's float32 model with and without the trained LoRA:
- **held-out text**: perplexity may rise by at most `max_perplexity_increase` (relative);
- **probes** (held-out questions with known answers): every answer the base model gets right
  (teacher-forced: each answer token the argmax) it must still get right;
- **taught examples**: the share of examples whose every target token the LoRA makes the argmax
  (teacher-forced), at least `min_taught`.
Feedback that teaches something false about a probe's subject fails the probes and is not promoted.

Scopes: one tenant's examples into that tenant's next version, or every tenant's (GLOBAL) into the
version served to every tenant that has none of its own.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from ruvllm.learning.config import InstantConfig
from ruvllm.learning.instant import InstantLearner, TenantState
from ruvllm.learning.tail import LearnedLayers, MicroLora, hidden_before

GLOBAL = "*"  # the policy store's tenant for what serves everyone


@dataclass(frozen=True)
class DeepConfig:
    # The instant loop's shape (rank, targets, layers), so the tenant's instant updates continue from
    # a promoted version.
    rank: int = 2
    alpha: float = 4.0
    layers: int = 4
    targets: tuple[str, ...] = ("v_proj", "o_proj", "down_proj")
    epochs: int = 8
    lr: float = 2e-3  # measured on the default model (docs/learning.md): gentler than the instant loop's
    ewc_lambda: float = 3e7  # the pull after each step (InstantLearner.consolidate); measured in docs/learning.md
    max_perplexity_increase: float = 0.01
    min_taught: float = 0.9
    rehearsal: int = 4  # chunks of everyday text trained on beside the examples
    candidates: int = 0  # the whole vocabulary (a sampled 2048 was measured worse: docs/learning.md)
    seed: int = 0


@dataclass
class DeepResult:
    scope: str
    examples: int
    steps: int
    seconds: float
    checks: dict[str, float] = field(default_factory=dict)
    failed: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return not self.failed


def _predicted(layers: LearnedLayers, lora: MicroLora | None, h: torch.Tensor, prompt_len: int) -> torch.Tensor:
    """Logits over the vocabulary of the rows after the prompt's last, from the hidden states h
    entering the learned layers of the whole sequence (hidden_before: the same with or without the
    LoRA, so computed once for both): [len(ids) - prompt_len, V]."""
    with torch.no_grad():
        out = layers.forward(h, torch.arange(h.shape[0]), lora)
        return out[prompt_len - 1:-1] @ layers.head.t()


def _right(logits: torch.Tensor, target: list[int]) -> torch.Tensor:
    return logits.argmax(-1) == torch.tensor(target)


def train_and_check(layers: LearnedLayers, examples: list[tuple[list[int], list[int]]], heldout: list[int],
                    probes: list[tuple[list[int], list[int]]], config: DeepConfig, scope: str,
                    start: MicroLora | None = None, general: list[int] | None = None) -> tuple[DeepResult, MicroLora]:
    """Fine-tune a LoRA on the examples (prompt, target), from `start` (the scope's serving weights:
    the deep loop consolidates what the instant loop learned) or fresh, and run the checks against
    the base model. `general`: everyday text (not the held-out text) for EWC++'s Fisher and for
    rehearsal: its chunks are trained on beside the examples, so the fine-tune keeps the model's
    ordinary text where it was."""
    t0 = time.perf_counter()
    instant = InstantLearner(layers, InstantConfig(layers=config.layers, rank=config.rank, alpha=config.alpha,
                                                   targets=config.targets, lr=config.lr, context="full",
                                                   candidates=config.candidates, ewc_lambda=config.ewc_lambda,
                                                   seed=config.seed))
    state: TenantState = instant.new_tenant(config.seed, None if start is None else start.peft_tensors())
    prepared = [instant.prepare(p, t, "full") for p, t in examples]
    rehearsal = [instant.prepare(general[i:i + 32], general[i + 32:i + 128], "full")
                 for i in range(0, len(general) - 127, 128)][:config.rehearsal] if general else []
    if config.ewc_lambda > 0 and rehearsal:
        instant.fold_fisher(state, instant.fisher_sample(state.lora, rehearsal))
    prepared += rehearsal
    rng = random.Random(config.seed)
    steps = 0
    for _ in range(config.epochs):
        order = list(range(len(prepared)))
        rng.shuffle(order)
        for i in order:
            instant.step(state, prepared[i], 1.0)
            instant.consolidate(state)  # EWC++'s pull after each step, as the background loop's
            steps += 1
    result = DeepResult(scope, len(examples), steps, 0.0)
    lora = state.lora
    h = hidden_before(layers.model, heldout, layers.first)
    labels = torch.tensor(heldout[1:])
    before, after = (float(F.cross_entropy(_predicted(layers, x, h, 1), labels).exp()) for x in (None, lora))
    result.checks["heldout_perplexity_before"] = before
    result.checks["heldout_perplexity_after"] = after
    if after > before * (1 + config.max_perplexity_increase):
        result.failed.append(f"held-out perplexity {before:.3f} -> {after:.3f} (at most "
                             f"+{100 * config.max_perplexity_increase:g}%)")
    right_before = kept = 0
    for prompt, answer in probes:
        h = hidden_before(layers.model, prompt + answer, layers.first)
        if _right(_predicted(layers, None, h, len(prompt)), answer).all():
            right_before += 1
            kept += int(_right(_predicted(layers, lora, h, len(prompt)), answer).all())
    result.checks["probes_right_before"] = right_before
    result.checks["probes_kept"] = kept
    if kept < right_before:
        result.failed.append(f"{right_before - kept} of the {right_before} probe answers the base model gets right "
                             "are lost")
    # an example is learned when every target token is the argmax: a fact's one telling token among
    # a dozen easy ones would pass a per-token count unlearned
    taught = prepared[:len(examples)]  # their hidden states from training; the rehearsal chunks were not taught
    hits = sum(int(_right(_predicted(layers, lora, p.h, p.prompt_len), p.target).all()) for p in taught)
    result.checks["taught_accuracy"] = hits / max(len(taught), 1)
    if hits / max(len(taught), 1) < config.min_taught:
        result.failed.append(f"{hits} of the {len(taught)} taught examples are learned (at least "
                             f"{100 * config.min_taught:.0f}%)")
    result.seconds = time.perf_counter() - t0
    return result, lora
