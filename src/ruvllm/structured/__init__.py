"""Structured outputs: constraints on what a request may generate (JSON schemas, regexes, choices,
EBNF grammars), compiled by xgrammar and applied as a per-row token mask in the batched sampler
(docs/structured.md)."""
