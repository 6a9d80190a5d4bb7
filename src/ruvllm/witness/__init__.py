"""The witness log (docs/learning.md): what was inferred, hash-chained in SQLite."""

from ruvllm.witness.log import Entry, Verdict, WitnessError, WitnessLog, find, token_hash, verify

__all__ = ["Entry", "Verdict", "WitnessError", "WitnessLog", "find", "token_hash", "verify"]
