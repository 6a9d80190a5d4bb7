"""Speculative decoding (docs/speculative.md): proposers guess a decoding sequence's next tokens
(ngram.py: prompt lookup; draft.py: a smaller model on its own paged cache), and verify.py keeps
the longest prefix of them that the target's own sampling agrees with, plus one token of its own."""
