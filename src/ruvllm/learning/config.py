"""Settings of learning from feedback (typed, torch-free: the server's config holds them), declared
as the engine's are: `ruvllm serve --learn` generates its flags from these fields."""

from __future__ import annotations

from dataclasses import dataclass, field

from ruvllm.config import Checked, setting


@dataclass(frozen=True)
class InstantConfig(Checked):
    layers: int = setting(4, "The last n decoder layers learn.", minimum=1, cli=False)
    rank: int = setting(2, "The micro-LoRA's rank.", minimum=1, cli=False)
    alpha: float = setting(4.0, "The micro-LoRA's alpha.", minimum=0, cli=False)
    targets: tuple[str, ...] = setting(("v_proj", "o_proj", "down_proj"), "Modules learned.", cli=False)
    lr: float = setting(1e-2, "Learning rate.", minimum=0, cli=False)
    # "frozen" (issue 37 item 1, session 16): the prompt's K/V through the learned layers computed once
    # without the micro-LoRA, only the target's rows learned through: a quarter of the full context's
    # rows (12 against 52 on Zorblax's pair), ~1.7x faster, and on the 8 held-apart facts the same
    # medians of hits as the full context run in the same session (question 20/20, paraphrase 18.5/20,
    # other tenant 0/20), perplexity +0.94% against +0.82% (docs/learning.md). "full": every row
    # under the micro-LoRA, as serving runs it.
    context: str = setting("frozen", "learning/instant.py (docs/learning.md).", choices=("full", "frozen"), cli=False)
    # The input gradient through packed weights (issue 37 item 1, session 17): "int8", the engine's
    # integer kernel over a transposed 8-bit copy of each learned projection (dY rounded to 8 bits
    # per block, as the forward's activations are; ~15 MB more memory on the default model);
    # "float32", the float kernel over the served codes (no copy). docs/learning.md has both's
    # figures and the gradients' distance from a float32 reference.
    backward: str = setting("int8", "The packed weights' backward.", choices=("int8", "float32"), cli=False)
    candidates: int = setting(2048, "Sampled softmax size; 0: the whole vocabulary.", minimum=0, cli=False)
    seed: int = setting(0, "Seeds the sampled softmax.", cli=False)
    # The drawn candidates do not depend on the event: the background pass draws and gathers the next
    # steps' ahead (learning/candidates.py), 2,048 head rows ~1.2-2 ms off the step when cold in the
    # caches; each batch is ~n x hidden x 4 bytes (4.7 MB on the default model, 17 MB at hidden 2048).
    candidates_ahead: int = setting(2, "Sampled softmax draws made ahead, off the feedback's path.", minimum=0,
                                    cli=False)
    # The sampled softmax's competitors (issue 37). Drawn uniformly alone, 2,048 of 49,152 rarely
    # include the tokens the model actually prefers at a row, so its loss fell to ~0.01 while the
    # full softmax's worst target token stayed at 1-2 nats: the fact held greedily and not under
    # sampling. So the base model's top `hard_negatives` tokens at each target row (found once per
    # (prompt, target) pair) are always candidates, and with `estimate_rest` the uniformly drawn
    # ones stand for the rest of the vocabulary (their logits + log(rest / drawn)), which makes the
    # loss an estimate of the full softmax's rather than a bound below it.
    hard_negatives: int = setting(32, "The base model's top tokens per target row kept as candidates.", minimum=0,
                                  cli=False)
    estimate_rest: bool = setting(True, "The drawn candidates stand for the rest of the vocabulary.", cli=False)
    # More than one step per event, until the worst target token's loss falls under `target_nll`
    # (nats; 0: always `steps_per_event`): a fact that one step a correction does not carry through
    # sampling gets more, one already held gets one. Each step costs a step's time (docs/learning.md).
    steps_per_event: int = setting(1, "Most gradient steps per feedback event.", minimum=1, cli=False)
    target_nll: float = setting(0.0, "Steps stop once every target token's loss is under this (nats).", minimum=0,
                                cli=False)
    # EWC++, applied by the background loop (learning/background.py): the penalty lambda * sum F
    # (theta - theta*)^2, theta* the micro-LoRA's starting point (the base model's behaviour) and F
    # an online diagonal Fisher of the LM loss on the tenant's own recent completions, refreshed
    # after `fisher_every` updates (F <- gamma F + (1 - gamma) g^2; an update is one event's step, or
    # one step over a coalesced backlog's events). lambda 0: off.
    # The default model's micro-LoRA Fisher is tiny (median 6e-9 a coordinate; docs/learning.md).
    ewc_lambda: float = setting(3e6, "EWC++'s lambda (0: off).", minimum=0, cli=False)
    fisher_every: int = setting(5, "Instant updates between Fisher refreshes.", minimum=1, cli=False)
    fisher_samples: int = setting(4, "Completions per Fisher refresh.", minimum=1, cli=False)
    fisher_gamma: float = setting(0.5, "The Fisher's decay.", minimum=0, maximum=1, cli=False)
    # A KL term toward the base model in the step (learning/anchor.py; issue 37, item 2): KL(base ||
    # adapter) over the base's top `kl_top` tokens (and the rest) at every row of the tenant's
    # `kl_samples` most recent everyday completions, weighed by `kl_weight` (0: off). Each
    # completion costs a forward and backward of the learned layers over its rows per step. At 2,
    # the 8 held-apart facts' medians meet all four goals (perplexity +0.96%; docs/learning.md).
    kl_weight: float = setting(2.0, "The KL term's weight in the step (0: off).", minimum=0, cli=False)
    kl_samples: int = setting(2, "Everyday completions in the KL term.", minimum=1, cli=False)
    kl_top: int = setting(32, "The base's top tokens a row kept for the KL term.", minimum=1, cli=False)
    # The correction also learned in the answer's position under this system prompt (issue 37, item
    # 2): the prompt's user message, found through the model's chat template, rendered again after it;
    # the step's loss is then the sum over both forms. "": off; a prompt that is not one user turn
    # of the template is learned in its own form only.
    system_prompt: str = setting("", "A system prompt the correction is also learned under.", cli=False)
    # The correction also learned under up to this many rewrites of its question that the served base
    # model writes (learning/rewrites.py; issue 37 item 2's first candidate): written once per
    # question (a request to the engine, ~2n samples), filtered, kept with the prepared pairs. 0: off;
    # docs/learning.md has its side-by-side figures.
    question_forms: int = setting(0, "Rewrites of the question the correction is also learned under.", minimum=0,
                                  maximum=8, cli=False)


@dataclass(frozen=True)
class LearningConfig(Checked):
    instant: InstantConfig = field(default_factory=InstantConfig)
    store_count: int = setting(10_000, "With --learn: completions kept for feedback, at most.",
                               flag="--feedback-keep", minimum=1)
    store_age_s: float = setting(3600.0, "With --learn: seconds a completion takes feedback.",
                                 flag="--feedback-max-age", minimum=1)
    root: str | None = setting(None, "With --learn: where adapter versions are written (PEFT folders; default: "
                                     "a data folder).", flag="--learned-dir", metavar="DIR")
    # `ruvllm serve` runs the engine core in a process of its own and gives the learner 1, so that
    # updates take one core from serving, not every core.
    threads: int | None = setting(None, "This process's PyTorch threads for the updates (None: as they are).",
                                  minimum=1, cli=False)
    # The background loop consolidates each tenant's instant updates under EWC++ at most this often
    # (seconds) while there are any, on a thread of its own. None: no thread; call
    # Learner.consolidate() (the offline LLM, which is not thread-safe). `ruvllm serve` uses 0.1.
    background_s: float | None = setting(None, "Seconds between consolidations.", minimum=0, cli=False)
    # The nice value of the threads that learn (the background loop's; the server's update thread,
    # never the caller's): on a machine with few cores, updates take what serving leaves
    # (docs/learning.md: serving 1.01x at 10, 0.77x at 0).
    nice: int = setting(10, "With --learn: the nice value of the threads that learn, so that updates take what "
                            "serving leaves of the CPU (0: as serving).", flag="--learn-nice", minimum=0, maximum=19,
                        metavar="N")
    # An update's time and memory grow with the correction (measured before this bound: 2k tokens took
    # 53 s and 1.3 GB, 4k tokens 221 s and 4 GB, on the one update thread everyone shares).
    feedback_max_tokens: int = setting(256, "With --learn: the longest correction, in tokens (a longer one gets "
                                            "400).", minimum=1, metavar="N")
    # A backlog coalesced (issue 37 item 3): when several feedback events wait for the update thread,
    # each tenant's are learned in one step over up to this many (InstantLearner.step_events; the KL
    # term toward the base computed once a step, not once an event), tenants in turn. Bounded because
    # the step's memory and time grow with the events it holds (every event's rows run through the
    # learned layers in one batch) and every event in it waits for the whole step. 16: beside 32
    # streams it absorbed 1.30x the events 8 did at the same cost to serving, 32 no more than 16
    # (docs/learning.md, session 23; 8 absorbed 1.4x what 4 did, session 21). 1: one step an event.
    update_batch: int = setting(16, "With --learn: most waiting feedback events of a tenant learned in one step "
                                   "(1: one step an event).", flag="--learn-batch", minimum=1, metavar="N")
    # Older ones are deleted with their policy-store rows; the serving one and every deep-loop promotion stay.
    keep_versions: int = setting(16, "Version folders kept per tenant (0: all).", minimum=0, cli=False)
    # Learning state held in memory (issue 33: RSS grew ~1.9 MB a learning tenant): the micro-LoRAs
    # with their Adam moments and Fisher of the `states_keep` most recently taught tenants (an
    # evicted tenant's is rebuilt from its serving version when it next learns, with fresh Adam
    # moments and Fisher), and the `prepared_keep` most recent prepared (prompt, target) pairs.
    states_keep: int = setting(64, "Tenants whose learning state stays in memory.", minimum=1, cli=False)
    prepared_keep: int = setting(64, "Prepared (prompt, target) pairs kept for later events.", minimum=1, cli=False)
