"""Incremental detokenization and stop strings.

Text is decoded over a short window of tokens so that a character split across tokens appears only
once all its bytes have arrived (a trailing U+FFFD means "incomplete": wait for the next token).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

# Prompt tokens decoded before the first output token, so tokenizers that drop a leading space at
# the start of a text (SentencePiece) render the first word as it reads in context.
_CONTEXT_TOKENS = 5


def ids_decoder(tokenizer: object, skip_special_tokens: bool) -> Callable[[list[int]], str]:
    """`tokenizer.decode(ids, skip_special_tokens=...)` as one callable. For a transformers fast
    tokenizer whose decode is the library's own and cleans up no spaces, that decode converts the ids
    to a list and calls its Rust backend's decode, nothing more: the backend is called directly then
    (the same string, without ~20 us of Python per call; a stream decodes twice per token)."""
    try:
        from transformers.tokenization_utils_base import PreTrainedTokenizerBase
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
    except ImportError:  # pragma: no cover - transformers is a dependency; a stand-in tokenizer may not be
        TokenizersBackend = PreTrainedTokenizerBase = None  # type: ignore[assignment,misc]
    cls = type(tokenizer)
    backend = getattr(tokenizer, "_tokenizer", None)
    if (TokenizersBackend is not None and isinstance(tokenizer, TokenizersBackend) and backend is not None
            and cls.decode is PreTrainedTokenizerBase.decode and cls._decode is TokenizersBackend._decode
            and not getattr(tokenizer, "clean_up_tokenization_spaces", False)):
        decode = backend.decode
        return lambda ids: decode(ids, skip_special_tokens=skip_special_tokens)
    slow = tokenizer.decode  # type: ignore[attr-defined]
    return lambda ids: slow(ids, skip_special_tokens=skip_special_tokens)


@dataclass
class IncrementalDetokenizer:
    tokenizer: object  # a transformers tokenizer
    prompt_token_ids: list[int]
    stop_strings: tuple[str, ...] = ()
    include_stop_str: bool = False
    skip_special_tokens: bool = True
    text: str = ""
    _tokens: list[int] = field(default_factory=list)
    _prefix_offset: int = 0
    _read_offset: int = 0
    _decode: Callable[[list[int]], str] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self._decode = ids_decoder(self.tokenizer, self.skip_special_tokens)
        self._tokens = list(self.prompt_token_ids[-_CONTEXT_TOKENS:])
        self._prefix_offset = 0
        # A prompt (given as token ids) may end inside a character: leave those bytes unread, so the
        # character appears in the output once generated tokens complete it.
        read = len(self._tokens)
        while read > 0 and self._decode(self._tokens[:read]).endswith("\ufffd"):
            read -= 1
        self._read_offset = read

    def add(self, token_id: int) -> str | None:
        """Feed one generated token. Returns the stop string if one now appears in the text."""
        self._tokens.append(token_id)
        before = self._decode(self._tokens[self._prefix_offset:self._read_offset])
        after = self._decode(self._tokens[self._prefix_offset:])
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return None
        old_len = len(self.text)
        self.text += after[len(before):]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._tokens)
        return self._find_stop(old_len)

    def _find_stop(self, old_len: int) -> str | None:
        best: tuple[int, str] | None = None
        for stop in self.stop_strings:
            # A stop string may straddle the previous text and the new delta.
            idx = self.text.find(stop, max(0, old_len - len(stop) + 1))
            if idx != -1 and (best is None or idx < best[0]):
                best = (idx, stop)
        if best is None:
            return None
        idx, stop = best
        self.text = self.text[: idx + len(stop)] if self.include_stop_str else self.text[:idx]
        return stop

    def visible_len(self, finished: bool) -> int:
        """How much of the text is safe to show: while running, a tail that could still become a stop
        string is held back."""
        if finished or not self.stop_strings or self.include_stop_str:
            return len(self.text)
        return max(0, len(self.text) - (max(len(s) for s in self.stop_strings) - 1))

    def visible_text(self, finished: bool) -> str:
        return self.text[: self.visible_len(finished)]
