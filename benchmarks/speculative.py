"""Speculative decoding on the default model, one stream: decode speed with and without it, in one run.

Tasks (greedy, chat template, up to --max-tokens each, one request at a time):
- grounded: --prompts passages of the novel (120 words each), each given in the prompt with the
  instruction to rewrite it keeping its words, and the reply begun with the passage's first eight
  words (as an editor's or a quoting assistant's reply is: most of the output is in the input);
- free: the same passages, asked to be repeated or continued with nothing of the reply given
  (the 135M model often paraphrases or comments instead: what prompt lookup gets then);
- chat: --prompts open questions (where prompt lookup rarely finds anything).

Configurations, each against its own target alone:
- ngram: prompt lookup (K = --k, n-grams of --ngram-min..--ngram-max) on the default engine;
- draft: the default model's file dense in fp32 (quantization none) as the target, the same file
  at its packed 4-bit precision as the draft (the best same-tokenizer pair available offline).

First, what verification costs here: one forward pass with every row's logits over 1 + k rows
(k proposals), against one row (`speculative.policy.step_seconds`, what the adaptive count measures
at load). Then: decode speed is tokens after the first over the time after the first token, summed over the task's
requests; ratios are against the same target without speculation. The greedy texts must be equal
(counted), and the acceptance rate and tokens per verification are the core's counters.

    .venv/bin/python benchmarks/speculative.py --prompts 20
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from rich.console import Console
from rich.progress import track
from rich.table import Table

BOOK = Path(__file__).resolve().parents[2] / "shared" / "data" / "pride-and-prejudice.txt"
QUESTIONS = [
    "What are the health benefits of drinking green tea?", "Write a short poem about autumn leaves.",
    "Explain how a bicycle stays upright.", "Give me three tips for a job interview.",
    "Why do cats purr?", "Describe a busy market in the morning.", "What is photosynthesis?",
    "Tell me a story about a brave mouse.", "How do I make a cup of coffee with a French press?",
    "What causes the seasons on Earth?", "Suggest a name for a bakery and explain it.",
    "Write a limerick about a forgetful wizard.", "What is the difference between weather and climate?",
    "How can I improve my sleep?", "Describe the taste of a lemon to someone who never had one.",
    "What should I pack for a weekend hiking trip?", "Explain what a computer program is to a child.",
    "Write a thank-you note to a teacher.", "Why is the ocean salty?", "Plan a simple vegetarian dinner.",
]


def passages(n: int) -> list[list[str]]:
    words = BOOK.read_text(encoding="utf-8").split()[3000:]
    return [words[i * 400:i * 400 + 120] for i in range(n)]


def grounded_prompts(n: int) -> list[tuple[str, str]]:
    """(the user's message, the start of the reply)"""
    return [(f"Rewrite this passage from the novel, keeping its words:\n\n{' '.join(p)}", " ".join(p[:8]))
            for p in passages(n)]


def free_prompts(n: int) -> list[tuple[str, str]]:
    return [((f"Repeat this passage from the novel word for word:\n\n{' '.join(p)}" if i % 2 == 0 else
              f"Here is a passage from the novel:\n\n{' '.join(p)}\n\nContinue it, reusing its sentences."), "")
            for i, p in enumerate(passages(n))]


def run(llm, asks: list[tuple[str, str]], max_tokens: int) -> tuple[float, list[list[int]]]:
    """(decode tokens/s over the requests, their greedy tokens), one request at a time."""
    from ruvllm import SamplingParams
    from ruvllm.engine.prompts import render_chat
    from ruvllm.messages import CoreRequest

    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    tokens, decode_s, decoded = [], 0.0, 0
    for i, (ask, reply_start) in enumerate(asks):
        ids = render_chat(llm.tokenizer, [{"role": "user", "content": ask}])
        if reply_start:
            ids = ids + llm.tokenizer.encode(reply_start, add_special_tokens=False)
        core = llm.core
        core.add_request(CoreRequest(f"r{i}-{time.monotonic_ns()}", ids, params, tuple(llm.eos_token_ids)))
        out: list[int] = []
        first = None
        while core.has_unfinished:
            for o in core.step():
                if o.new_token_ids and first is None:
                    first = time.perf_counter()
                out.extend(o.new_token_ids)
        decode_s += time.perf_counter() - first
        decoded += len(out) - 1
        tokens.append(out)
    return decoded / decode_s, tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=20)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--k", type=int, default=8)
    ap.add_argument("--ngram-min", type=int, default=None)
    ap.add_argument("--ngram-max", type=int, default=None)
    ap.add_argument("--skip-draft", action="store_true")
    ap.add_argument("--costs-only", action="store_true", help="the verification cost table only")
    args = ap.parse_args()

    from ruvllm import LLM
    from ruvllm.config import SpeculativeConfig
    from ruvllm.loader.default_model import default_model_path

    tasks = {"grounded": grounded_prompts(args.prompts), "free": free_prompts(args.prompts),
             "chat": [(q, "") for q in QUESTIONS[:args.prompts]]}
    extra = {k: v for k, v in (("ngram_min", args.ngram_min), ("ngram_max", args.ngram_max)) if v is not None}
    ngram = SpeculativeConfig(speculative="ngram", num_speculative_tokens=args.k, **extra)
    draft = SpeculativeConfig(speculative_model=str(default_model_path()), speculative_quantization="auto",
                              num_speculative_tokens=args.k)
    default = LLM()
    from ruvllm.speculative.policy import step_seconds

    costs = Table(title="verification cost: one pass with every row's logits (default model, fastest of 5)")
    for col in ("proposals", "ms", "x one row"):
        costs.add_column(col, justify="right")
    one = step_seconds(default.core.executor.runner, 1, repeats=5)
    for k in (0, 1, 2, 4, 8):
        t = step_seconds(default.core.executor.runner, 1 + k, repeats=5)
        costs.add_row(str(k), f"{t * 1000:.1f}", f"{t / one:.2f}")
    Console().print(costs)
    if args.costs_only:
        return
    pairs = [("ngram", default, default.with_settings(speculation=ngram))]
    if not args.skip_draft:
        dense = LLM(quantization="none", dtype="float32")
        pairs.append(("draft (4-bit for fp32)", dense, dense.with_settings(speculation=draft)))

    table = Table(title=f"speculative decoding, one stream, greedy, up to {args.max_tokens} tokens, K={args.k}")
    for col in ("task", "speculation", "target alone tok/s", "with it tok/s", "ratio", "acceptance",
                "tokens / verification", "same text"):
        table.add_column(col, justify="left" if col in ("task", "speculation") else "right")
    for name, base, spec in pairs:
        run(base, tasks["chat"][:1], 16)  # warm both up
        run(spec, tasks["chat"][:1], 16)
        for task, asks in tasks.items():
            before = spec.stats()
            base_tps, base_tokens = 0.0, []
            spec_tps, spec_tokens = 0.0, []
            for _ in track(range(1), description=f"{name}, {task}", transient=True):
                base_tps, base_tokens = run(base, asks, args.max_tokens)
                spec_tps, spec_tokens = run(spec, asks, args.max_tokens)
            after = spec.stats()
            proposed = after.spec_proposed - before.spec_proposed
            accepted = after.spec_accepted - before.spec_accepted
            verifications = after.spec_verifications - before.spec_verifications
            same = sum(a == b for a, b in zip(base_tokens, spec_tokens))
            table.add_row(task, name, f"{base_tps:.1f}", f"{spec_tps:.1f}", f"{spec_tps / base_tps:.2f}x",
                          f"{accepted / max(proposed, 1):.1%}", f"{1 + accepted / max(verifications, 1):.2f}",
                          f"{same}/{len(asks)}")
    Console().print(table)


if __name__ == "__main__":
    main()
