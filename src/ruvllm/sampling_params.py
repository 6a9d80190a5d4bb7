"""Per-request sampling settings, validated on construction."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from ruvllm.structured.spec import StructuredOutputs

# What torch.Generator.manual_seed takes: a signed or unsigned 64-bit integer.
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1


@dataclass
class SamplingParams:
    """How to pick tokens for one request. Invalid values raise ValueError naming the field."""

    n: int = 1
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    repetition_penalty: float = 1.0  # multiplicative, on prompt and output tokens (CTRL / HF style)
    presence_penalty: float = 0.0  # additive, on output tokens (OpenAI style)
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] | None = None
    seed: int | None = None
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    max_tokens: int | None = 16  # None: up to the context length
    min_tokens: int = 0
    logprobs: int | None = None  # number of top logprobs per generated token (0: only the chosen one)
    prompt_logprobs: int | None = None  # the same for every prompt token after the first (echo scoring)
    # Tokens whose logprobs (and ranks) every generated position reports beside the chosen and top ones,
    # however unlikely they are: a yes/no judgment's two answers (server/rerank.py). Needs `logprobs`.
    logprob_token_ids: tuple[int, ...] | None = None
    skip_special_tokens: bool = True
    # What the output must match (a JSON schema, a regex, a choice, a grammar): docs/structured.md
    structured: StructuredOutputs | None = None
    stop_strings: tuple[str, ...] = field(init=False, default=())

    def __post_init__(self) -> None:
        def bad(name: str, why: str) -> ValueError:
            return ValueError(f"{name} {why}")

        for name in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty",
                     "frequency_penalty"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise bad(name, f"must be a finite number, got {value!r}")
        if not isinstance(self.n, int) or self.n < 1:
            raise bad("n", f"must be an integer >= 1, got {self.n!r}")
        if self.temperature < 0:
            raise bad("temperature", f"must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", f"must be in (0, 1], got {self.top_p}")
        if self.top_k == -1:
            self.top_k = 0
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise bad("top_k", f"must be 0 / -1 (off) or a positive integer, got {self.top_k!r}")
        if not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", f"must be in [0, 1], got {self.min_p}")
        if self.repetition_penalty <= 0:
            raise bad("repetition_penalty", f"must be > 0, got {self.repetition_penalty}")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise bad("presence_penalty", f"must be in [-2, 2], got {self.presence_penalty}")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise bad("frequency_penalty", f"must be in [-2, 2], got {self.frequency_penalty}")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            raise bad("max_tokens", f"must be an integer >= 1, got {self.max_tokens!r}")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            raise bad("min_tokens", f"must be an integer >= 0, got {self.min_tokens!r}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad("min_tokens", f"({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or not 0 <= self.logprobs <= 20):
            raise bad("logprobs", f"must be an integer in [0, 20], got {self.logprobs!r}")
        if self.prompt_logprobs is not None and (
                not isinstance(self.prompt_logprobs, int) or not 0 <= self.prompt_logprobs <= 20):
            raise bad("prompt_logprobs", f"must be an integer in [0, 20], got {self.prompt_logprobs!r}")
        if self.logprob_token_ids is not None:
            if not isinstance(self.logprob_token_ids, (list, tuple)):
                raise bad("logprob_token_ids", f"must be a list of token ids, got {self.logprob_token_ids!r}")
            self.logprob_token_ids = tuple(self.logprob_token_ids)
            if self.logprobs is None:
                raise bad("logprob_token_ids", "needs logprobs (0: no top tokens beside them)")
            if not 1 <= len(self.logprob_token_ids) <= 20 or any(
                    isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in self.logprob_token_ids):
                raise bad("logprob_token_ids", f"must be 1 to 20 token ids, got {self.logprob_token_ids!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)
                                      or not SEED_MIN <= self.seed <= SEED_MAX):
            raise bad("seed", f"must be an integer in [{SEED_MIN}, {SEED_MAX}], got {self.seed!r}")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.stop is not None and not isinstance(self.stop, (list, tuple)):
            raise bad("stop", f"must be a string or a list of strings, got {self.stop!r}")
        stops = tuple(s for s in (self.stop or []) if s)
        if any(not isinstance(s, str) for s in stops):
            raise bad("stop", "must be a string or a list of strings")
        self.stop_strings = stops
        for tid in self.stop_token_ids or []:
            if not isinstance(tid, int) or tid < 0:
                raise bad("stop_token_ids", f"must be non-negative integers, got {tid!r}")
        if self.structured is not None:
            if not isinstance(self.structured, StructuredOutputs):
                raise bad("structured", f"must be StructuredOutputs, got {type(self.structured).__name__}")
            # the grammar ends its output with an end-of-sequence token: these would forbid that token
            if self.ignore_eos:
                raise bad("ignore_eos", "cannot be used with structured outputs (the grammar ends on end-of-sequence)")
            if self.min_tokens:
                raise bad("min_tokens", "cannot be used with structured outputs (the grammar decides the length)")
        if self.logit_bias:
            self.logit_bias = {int(k): float(v) for k, v in self.logit_bias.items()}
            for k, v in self.logit_bias.items():
                if not -100.0 <= v <= 100.0:
                    raise bad("logit_bias", f"values must be in [-100, 100], got {v} for token {k}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def needs_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    def needs_truncation(self) -> bool:
        return self.top_k > 0 or self.top_p < 1.0 or self.min_p > 0.0
