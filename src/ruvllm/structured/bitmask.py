"""The grammar's per-row token mask inside the batched sampler. Only rows with a constraint are
touched (one fill per row from its matcher, one masking over those rows); a batch without one pays
a single Python check."""

from __future__ import annotations

import functools
from typing import Any, Sequence

import torch

_SHIFTS = torch.arange(32, dtype=torch.int32)


def has_grammar(reqs: Sequence[Any]) -> bool:
    return any(r.matcher is not None for r in reqs)


def apply_grammar_masks(logits: torch.Tensor, reqs: Sequence[Any]) -> None:
    """logits [B, V], in place: each constrained row's tokens that its grammar forbids next -> -inf.
    The mask is xgrammar's bitmask (bit j of word w allows token 32 w + j), filled by each row's
    matcher and applied by our C++ kernel on the CPU (layers/csrc/token_mask.cpp), elsewhere (or
    without the kernels) unpacked with torch ops. Measured with real JSON masks at 32 rows of
    49,152 tokens: docs/structured.md."""
    rows = [i for i, r in enumerate(reqs) if r.matcher is not None and not r.matcher.is_terminated()
            and not getattr(r.matcher, "waiting", False)]  # a grammar that starts after reasoning: not yet
    if not rows:
        return
    vocab = logits.shape[1]
    words = torch.empty(len(rows), (vocab + 31) // 32, dtype=torch.int32)
    for j, i in enumerate(rows):
        reqs[i].matcher.fill_next_token_bitmask(words, j)
    ext = _kernels() if logits.device.type == "cpu" and logits.dtype == torch.float32 \
        and logits.is_contiguous() else None
    if ext is not None:
        ext.apply_token_bitmask(logits, words, torch.tensor(rows, dtype=torch.long))
    else:
        unpack_and_mask(logits, words, rows)


def unpack_and_mask(logits: torch.Tensor, words: torch.Tensor, rows: list[int]) -> None:
    """The torch-ops path: the bits unpacked to a bool mask, -inf where a bit is 0."""
    vocab = logits.shape[1]
    allowed = ((words.unsqueeze(-1) >> _SHIFTS) & 1).view(len(rows), -1)[:, :vocab].bool().to(logits.device)
    if len(rows) == logits.shape[0]:
        logits.masked_fill_(~allowed, float("-inf"))
    else:
        index = torch.tensor(rows, device=logits.device)
        logits[index] = logits[index].masked_fill(~allowed, float("-inf"))


@functools.cache
def _kernels() -> Any:
    from ruvllm.cpu_build import kernels

    return kernels()


def new_matcher(compiled: Any, after_tokens: tuple[int, ...] | None = None) -> Any:
    """`after_tokens` (a thinking model's end of reasoning): the grammar starts once the output has
    ended with them (AfterTokens)."""
    import xgrammar as xgr

    matcher = xgr.GrammarMatcher(compiled)
    return matcher if after_tokens is None else AfterTokens(matcher, after_tokens)


class AfterTokens:
    """A grammar matcher that constrains nothing until the output has ended with `trigger` (the end
    of a model's reasoning), then is the grammar's matcher: a thinking model reasons in free text and
    its answer matches the constraint. The same calls as xgrammar's matcher (accept_token, rollback,
    is_terminated; fill_next_token_bitmask once started); `waiting` tells the mask to skip the row.
    Per sequence, fed only its own tokens: a batch changes nothing of it."""

    def __init__(self, matcher: Any, trigger: tuple[int, ...]) -> None:
        self.matcher, self.trigger = matcher, tuple(trigger)
        self.seen: list[int] = []  # tokens accepted while waiting, the trigger's last included
        self.waiting = True
        self.after = 0  # tokens the grammar accepted since it started (what a rollback undoes first)

    def is_terminated(self) -> bool:
        return not self.waiting and self.matcher.is_terminated()

    def accept_token(self, token: int) -> bool:
        if not self.waiting:
            ok = self.matcher.accept_token(token)
            self.after += ok
            return ok
        self.seen.append(token)
        n = len(self.trigger)
        if len(self.seen) >= n and tuple(self.seen[-n:]) == self.trigger:
            self.waiting = False
        return True

    def fill_next_token_bitmask(self, words: Any, row: int) -> Any:
        return self.matcher.fill_next_token_bitmask(words, row)

    def rollback(self, n: int) -> None:
        """Undo the last n accepted tokens (speculative proposals): the grammar's first, then the
        waiting ones (the trigger's last among them starts the wait again)."""
        k = min(n, self.after)
        if k:
            self.matcher.rollback(k)
            self.after -= k
        n -= k
        if n:
            self.waiting = True
            del self.seen[-n:]
