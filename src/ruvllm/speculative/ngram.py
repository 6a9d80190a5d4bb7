"""Prompt lookup: propose the tokens that followed the last time the sequence's latest n tokens
appeared in it (prompt or output). Costs a dict lookup per n, so a sequence with no match pays
nothing measurable."""

from __future__ import annotations


class NgramIndex:
    """One sequence's n-grams (n in [n_min, n_max]) -> the position right after their latest
    occurrence, kept up to date as tokens are appended (each token adds n_max - n_min + 1 entries)."""

    def __init__(self, n_min: int, n_max: int) -> None:
        self.n_min, self.n_max = n_min, n_max
        self.tokens: list[int] = []
        self._next: dict[tuple[int, ...], int] = {}

    def extend(self, tokens: list[int]) -> None:
        for token in tokens:
            # The n-grams that end just before this token now have a continuation: this position.
            t = len(self.tokens)
            for n in range(self.n_min, min(self.n_max, t) + 1):
                self._next[tuple(self.tokens[t - n:t])] = t
            self.tokens.append(token)

    def propose(self, k: int) -> list[int]:
        """Up to k tokens after the latest earlier occurrence of the longest matching suffix."""
        t = len(self.tokens)
        for n in range(min(self.n_max, t), self.n_min - 1, -1):
            start = self._next.get(tuple(self.tokens[t - n:]))
            if start is not None:
                return self.tokens[start:min(start + k, t)]
        return []
