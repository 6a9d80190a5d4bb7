"""xgrammar against llguidance on this CPU, with the default model's tokenizer: what choosing one
for structured outputs rests on (docs/structured.md).

For each engine: the one-off tokenizer set-up; compiling a typical JSON schema, the any-JSON grammar
and a regex (cold: a fresh compiler each time); and, walking the tokens of a document that the
schema accepts, the per-token cost of filling the next-token bitmask and of advancing the matcher.

    .venv/bin/pip install llguidance   # the peer compared with; not a dependency of ruvllm
    .venv/bin/python benchmarks/grammar_engines.py --repeats 5
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from rich.console import Console
from rich.table import Table

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "email": {"type": "string"},
        "tags": {"type": "array", "items": {"type": "string", "enum": ["admin", "user", "guest"]}},
        "address": {"type": "object", "properties": {"street": {"type": "string"}, "city": {"type": "string"},
                                                     "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                    "required": ["street", "city"]},
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "tags", "address", "active"],
}
DOCUMENT = {"name": "Elizabeth Bennet", "age": 20, "email": "lizzy@longbourn.example", "tags": ["user", "guest"],
            "address": {"street": "Longbourn House", "city": "Meryton", "zip": "12345"}, "active": True}
REGEX = r"(\+44|0)[0-9]{4} [0-9]{6}"


def ms(f, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        f()
        times.append((time.perf_counter() - t) * 1000)
    return statistics.median(times)


def xgrammar_figures(tok, vocab: int, doc: list[int], repeats: int) -> dict[str, float]:
    import xgrammar as xgr

    t = time.perf_counter()
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=vocab)
    setup = (time.perf_counter() - t) * 1000
    schema = json.dumps(SCHEMA)
    out = {"tokenizer set-up (once)": setup,
           "compile: the schema": ms(lambda: xgr.GrammarCompiler(info, cache_enabled=False).compile_json_schema(schema),
                                     repeats),
           "compile: any JSON": ms(lambda: xgr.GrammarCompiler(info, cache_enabled=False).compile_builtin_json_grammar(),
                                   repeats),
           "compile: the regex": ms(lambda: xgr.GrammarCompiler(info, cache_enabled=False).compile_regex(REGEX),
                                    repeats)}
    compiled = xgr.GrammarCompiler(info).compile_json_schema(schema)
    mask = xgr.allocate_token_bitmask(1, vocab)
    matcher = xgr.GrammarMatcher(compiled)
    logits = torch.randn(1, vocab)
    return out | walk(doc, lambda: matcher.fill_next_token_bitmask(mask, 0), matcher.accept_token,
                      lambda: xgr.apply_token_bitmask_inplace(logits, mask))


def walk(doc: list[int], fill, advance, apply) -> dict[str, float]:
    """Per token of the document: fill the next-token mask, then advance the matcher by the token."""
    fills, advances = [], []
    for token in doc:
        t = time.perf_counter()
        fill()
        t1 = time.perf_counter()
        assert advance(token), "the engine refused a token of the document"
        fills.append((t1 - t) * 1e6)
        advances.append((time.perf_counter() - t1) * 1e6)
    return {"mask fill per token p50 (us)": statistics.median(fills),
            "mask fill per token max (us)": max(fills),
            "advance per token p50 (us)": statistics.median(advances),
            "apply mask to logits (us)": ms(apply, 50) * 1000}


def llguidance_figures(tok, vocab: int, doc: list[int], repeats: int) -> dict[str, float]:
    import llguidance
    import llguidance.hf
    import llguidance.torch as lt

    t = time.perf_counter()
    lltok = llguidance.hf.from_tokenizer(tok, n_vocab=vocab)
    setup = (time.perf_counter() - t) * 1000
    grammar = llguidance.LLMatcher.grammar_from_json_schema(SCHEMA)
    any_json = llguidance.LLMatcher.grammar_from_json_schema({})
    regex = llguidance.LLMatcher.grammar_from_regex(REGEX)

    def first_mask(g: str) -> None:  # llguidance compiles lazily: a matcher and its first mask
        m = llguidance.LLMatcher(lltok, g)
        lt.fill_next_token_bitmask(m, lt.allocate_token_bitmask(1, vocab), 0)
        assert not m.is_error(), m.get_error()

    out = {"tokenizer set-up (once)": setup,
           "compile: the schema": ms(lambda: first_mask(grammar), repeats),
           "compile: any JSON": ms(lambda: first_mask(any_json), repeats),
           "compile: the regex": ms(lambda: first_mask(regex), repeats)}
    matcher = llguidance.LLMatcher(lltok, grammar)
    mask = lt.allocate_token_bitmask(1, vocab)
    logits = torch.randn(1, vocab)
    return out | walk(doc, lambda: lt.fill_next_token_bitmask(matcher, mask, 0), matcher.consume_token,
                      lambda: lt.apply_token_bitmask_inplace(logits, mask))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    from ruvllm.loader import load_model_config, load_tokenizer, resolve_model

    src = resolve_model(None)
    tok = load_tokenizer(src)
    vocab = load_model_config(src).vocab_size
    doc = tok.encode(json.dumps(DOCUMENT), add_special_tokens=False)
    figures = {"xgrammar": xgrammar_figures(tok, vocab, doc, args.repeats),
               "llguidance": llguidance_figures(tok, vocab, doc, args.repeats)}
    table = Table(title=f"Grammar engines on the default model's tokenizer ({vocab:,} tokens; a {len(doc)}-token "
                        f"document; median of {args.repeats}; ms unless said; {torch.get_num_threads()} threads)")
    table.add_column("what")
    for name in figures:
        table.add_column(name, justify="right")
    for key in figures["xgrammar"]:
        table.add_row(key, *[f"{figures[n][key]:.2f}" for n in figures])
    Console().print(table)


if __name__ == "__main__":
    main()
