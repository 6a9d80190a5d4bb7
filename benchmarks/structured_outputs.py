"""Structured outputs on the default model: the guarantee, and what the grammar costs.

1. The guarantee: --schemas random JSON schemas (nested objects, arrays, enums, bounded numbers,
   required fields), --per-schema completions each at temperature 0.8, asked for JSON matching the
   schema; how many parse and validate with the grammar, and with the same prompts and seeds
   without it (what the grammar does).
2. The overhead: --streams streams of --tokens tokens at once, all under a JSON schema that keeps
   them going to the token limit, against the same streams unconstrained (ignore_eos), in one run;
   aggregate tokens a second, median of --repeats.
3. The per-step mask cost at --streams rows (the matchers' fills and the masked_fill), and the
   compile time of a typical schema (a fresh compiler: no cache).

    .venv/bin/python benchmarks/structured_outputs.py --schemas 50 --per-schema 2 --streams 32
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.progress import track
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent))
from grammar_engines import SCHEMA  # noqa: E402  # the typical schema

LONG = {"type": "array", "items": {"type": "string", "maxLength": 40}, "minItems": 200}


def valid(text: str, schema: dict) -> bool:
    import jsonschema

    try:
        jsonschema.validate(json.loads(text), schema)
        return True
    except (ValueError, jsonschema.ValidationError):
        return False


def guarantee(llm, schemas: list[dict], per: int) -> dict[str, tuple[int, int, int]]:
    """{with / without grammar: (valid, stopped for length, total)}."""
    from ruvllm import SamplingParams
    from ruvllm.engine.prompts import render_chat
    from ruvllm.structured.spec import StructuredOutputs

    prompts, jobs = [], []
    for i, schema in enumerate(schemas):
        for k in range(per):
            prompts.append(render_chat(llm.tokenizer, [{"role": "user", "content": "Reply with only a JSON value "
                                                        "matching this JSON schema: " + json.dumps(schema)}]))
            jobs.append((schema, 1000 * i + k))
    out = {}
    for label, constrain in (("with the grammar", True), ("without it", False)):
        params = [SamplingParams(temperature=0.8, seed=seed, max_tokens=256,
                                 structured=StructuredOutputs(json_schema=s) if constrain else None)
                  for s, seed in jobs]
        results = llm.generate(prompts, params)
        ok = sum(valid(r.outputs[0].text, s) for r, (s, _) in zip(results, jobs))
        length = sum(r.outputs[0].finish_reason == "length" for r in results)
        out[label] = (ok, length, len(jobs))
    return out


def overhead(llm, streams: int, tokens: int, repeats: int) -> dict[str, float]:
    from ruvllm import SamplingParams
    from ruvllm.structured.spec import StructuredOutputs

    prompts = [f"List {200 + i} short names as a JSON array of strings:" for i in range(streams)]
    runs: dict[str, list[float]] = {"unconstrained": [], "all under a JSON schema": []}
    spec = StructuredOutputs(json_schema=LONG)
    llm.generate(prompts[:2], SamplingParams(max_tokens=4, structured=spec))  # compiled and cached
    for _ in track(range(repeats), description="overhead rounds"):
        for label in runs:
            params = SamplingParams(temperature=0.8, seed=1, max_tokens=tokens,
                                    **({"ignore_eos": True} if label == "unconstrained" else {"structured": spec}))
            t = time.perf_counter()
            outs = llm.generate(prompts, params)
            n = sum(len(o.outputs[0].token_ids) for o in outs)
            runs[label].append(n / (time.perf_counter() - t))
    return {k: statistics.median(v) for k, v in runs.items()}


def mask_cost(llm, rows: int) -> tuple[float, float]:
    """(mask per step at `rows` rows in ms, cold compile of the typical schema in ms)."""
    import xgrammar as xgr

    from ruvllm.layers.sampler import SamplingState
    from ruvllm import SamplingParams
    from ruvllm.structured.bitmask import apply_grammar_masks

    info = xgr.TokenizerInfo.from_huggingface(llm.tokenizer, vocab_size=llm.info.vocab_size,
                                              stop_token_ids=list(llm.info.eos_token_ids))
    compiles = []
    for _ in range(5):
        t = time.perf_counter()
        compiled = xgr.GrammarCompiler(info, cache_enabled=False).compile_json_schema(json.dumps(SCHEMA),
                                                                                      any_whitespace=False)
        compiles.append((time.perf_counter() - t) * 1000)
    states = [SamplingState(str(i), SamplingParams(), [1], matcher=xgr.GrammarMatcher(compiled)) for i in range(rows)]
    doc = llm.tokenizer.encode('{"name": "Elizabeth", "age": 20', add_special_tokens=False)
    logits = torch.randn(rows, llm.info.vocab_size)
    times = []
    for token in doc:
        t = time.perf_counter()
        apply_grammar_masks(logits, states)
        times.append((time.perf_counter() - t) * 1000)
        for s in states:
            s.matcher.accept_token(token)
    return statistics.median(times), statistics.median(compiles)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--schemas", type=int, default=50)
    ap.add_argument("--per-schema", type=int, default=2)
    ap.add_argument("--streams", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--skip-guarantee", action="store_true", help="measure the overhead only")
    args = ap.parse_args()
    from ruvllm import LLM
    from ruvllm.structured.random_schemas import random_schema

    console = Console()
    llm = LLM(max_num_seqs=max(64, args.streams))
    rng = random.Random(0)
    schemas = [random_schema(rng) for _ in range(args.schemas)]
    g = {} if args.skip_guarantee else guarantee(llm, schemas, args.per_schema)
    o = overhead(llm, args.streams, args.tokens, args.repeats)
    step_ms, compile_ms = mask_cost(llm, args.streams)

    t1 = Table(title=f"The guarantee: {args.schemas} random schemas x {args.per_schema}, temperature 0.8, "
                     f"at most 256 tokens (default model)")
    for col in ("", "valid", "stopped for length", "invalid otherwise"):
        t1.add_column(col)
    for label, (ok, length, total) in g.items():
        t1.add_row(label, f"{ok}/{total}", str(length), str(total - ok - length))
    t2 = Table(title=f"The overhead: {args.streams} streams x {args.tokens} tokens, median of {args.repeats} "
                     f"({torch.get_num_threads()} threads)")
    for col in ("run", "aggregate tok/s", "ratio"):
        t2.add_column(col, justify="right")
    base = o["unconstrained"]
    for label, tps in o.items():
        t2.add_row(label, f"{tps:.1f}", f"{tps / base:.3f}x")
    t2.add_row(f"mask per step at {args.streams} rows", f"{step_ms:.2f} ms", "")
    t2.add_row("compile of a typical schema (cold)", f"{compile_ms:.1f} ms", "")
    if g:
        console.print(t1)
    console.print(t2)


if __name__ == "__main__":
    main()
