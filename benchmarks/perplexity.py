"""Perplexity of the engine on a text file, per precision, side by side in one run.

A precision is fp32, bf16 (dense bf16 weights), default (the engine's defaults on this machine), or
a quantization method (auto, none, int8, int4, int4-g64, int4-g128: bf16 compute); e.g.
`--precisions fp32 bf16 auto int8 int4-g128`. A "+dense-head" suffix keeps the LM head dense
(`default+dense-head`: the default with a float head instead of auto's 8-bit one). A row may
name its own model as PRECISION@PATH (a GGUF file or Hugging Face folder, e.g. one written by
`ruvllm quantize`); rows without one use --model (default: the embedded model).

The text is cut into windows of --window tokens (no overlap); each window is one prompt scored with
prompt logprobs (the engine's own path: paged cache, chunked prefill). Also reports greedy agreement
with the first precision on a few prompts (share of generated tokens identical to the reference's).

    .venv/bin/python benchmarks/perplexity.py ../shared/data/pride-and-prejudice.txt --precisions fp32 bf16 auto
    .venv/bin/python benchmarks/perplexity.py ../shared/data/pride-and-prejudice.txt --precisions fp32 auto@/tmp/awq-g64
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from ruvllm import LLM, SamplingParams

AGREEMENT_PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,",
                     "The three primary colours are", "Water boils at"]


def perplexity(llm: LLM, text: str, window: int, max_tokens: int) -> tuple[float, int]:
    ids = llm.tokenizer.encode(text, add_special_tokens=False)[:max_tokens]
    windows = [ids[i:i + window] for i in range(0, len(ids) - 1, window) if len(ids[i:i + window]) > 1]
    outs = llm.generate(windows, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0), show_progress=True)
    nll, count = 0.0, 0
    for w, out in zip(windows, outs):
        for pos in range(1, len(w)):
            nll -= out.prompt_logprobs[pos][w[pos]].logprob
            count += 1
    return math.exp(nll / count), count


def greedy(llm: LLM, n: int) -> list[list[int]]:
    outs = llm.generate(AGREEMENT_PROMPTS, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
    return [o.outputs[0].token_ids for o in outs]


def engine_settings(precision: str) -> dict:
    """LLM keyword settings for a precision name."""
    name, plus, _ = precision.partition("+dense-head")
    settings: dict = {"keep_16bit": ("embed_tokens", "lm_head")} if plus else {}
    if name == "default":
        return settings
    if name in ("fp32", "float32"):
        return settings | {"dtype": "float32", "quantization": "none"}
    if name in ("bf16", "bfloat16"):
        return settings | {"dtype": "bfloat16", "quantization": "none"}
    method, _, group = name.partition("-g")
    settings |= {"dtype": "bfloat16", "quantization": method}
    if group:
        settings["group_size"] = int(group)
    return settings


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("path", type=Path)
    ap.add_argument("--model", default=None, help="model of the rows that name none (default: the embedded one)")
    ap.add_argument("--precisions", nargs="+", default=["fp32", "bf16", "auto"], metavar="PRECISION[@PATH]")
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--max-tokens", type=int, default=16384, help="tokens of the text to score")
    ap.add_argument("--gen", type=int, default=32, help="tokens per prompt for greedy agreement")
    args = ap.parse_args()
    text = args.path.read_text(encoding="utf-8")
    rows = []
    reference = None
    for row in args.precisions:
        precision, _, path = row.partition("@")
        llm = LLM(path or args.model, max_num_batched_tokens=2048, **engine_settings(precision))
        t0 = time.perf_counter()
        ppl, n = perplexity(llm, text, args.window, args.max_tokens)
        seconds = time.perf_counter() - t0
        tokens = greedy(llm, args.gen)
        if reference is None:
            reference = tokens
        same = sum(a == b for r, t in zip(reference, tokens) for a, b in zip(r, t))
        label = f"{precision}@{Path(path).name}" if path else precision
        rows.append((label, ppl, n, seconds, same / sum(len(r) for r in reference)))
    table = Table(title=f"perplexity on {args.path.name} ({args.window}-token windows)")
    table.add_column("precision", justify="right", overflow="fold")  # PRECISION@FOLDER labels in full
    for col in ("perplexity", "vs first", "tokens scored", "seconds", "greedy agreement"):
        table.add_column(col, justify="right")
    for precision, ppl, n, seconds, agree in rows:
        table.add_row(precision, f"{ppl:.4f}", f"{100 * (ppl / rows[0][1] - 1):+.2f}%", str(n), f"{seconds:.1f}",
                      f"{100 * agree:.1f}%")
    Console().print(table)


if __name__ == "__main__":
    main()
