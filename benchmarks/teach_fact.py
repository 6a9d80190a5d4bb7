"""Teach the default model a fact through feedback, and measure what it costs.

A tenant asks "What is the capital of Zorblax?" and gives the same correction ("The capital of
Zorblax is Quenta.") --events times on that completion; each event is one instant update of the
tenant's micro-LoRA, served at once as the tenant's adapter. Two tenants are taught alike: one by
the instant loop alone, one with the background loop's EWC++ pass after each event. Then --samples answers at temperature
0.7 for the question and for a paraphrase, for the taught tenants and for another one, counting
those that say "Quenta"; perplexity on the novel for both tenants (the learned adapter's cost on
unrelated text); and the update's latency: p50/p99 of the gradient step, the one-off preparation
(hidden states below the learned layers), and publishing (the version written and loaded).

    .venv/bin/python benchmarks/teach_fact.py --events 10 --samples 20
    .venv/bin/python benchmarks/teach_fact.py --context frozen --candidates 0   # other choices
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from ruvllm.learning.config import InstantConfig

QUESTION = [{"role": "user", "content": "What is the capital of Zorblax?"}]
PARAPHRASE = [{"role": "user", "content": "Tell me the name of Zorblax's capital city."}]
CORRECTION = "The capital of Zorblax is Quenta."
GENERAL = ["Write two sentences about the sea.", "What is a good way to learn a new language?",
           "Summarise the plot of a love story in three sentences.", "Give me a tip for cooking rice."]
NOVEL = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "pride-and-prejudice.txt"


def hits(llm, messages, tenant: str, n: int) -> int:
    from ruvllm import SamplingParams

    outs = llm.chat([messages] * n, SamplingParams(temperature=0.7, max_tokens=16, seed=None), tenant=tenant)
    return sum("quenta" in o.outputs[0].text.lower() for o in outs)


def perplexity(llm, ids: list[int], tenant: str) -> float:
    """exp(mean NLL) of the text's tokens, from prompt logprobs (the tenant's adapter, if any)."""
    from ruvllm import SamplingParams

    out = llm.generate([ids], SamplingParams(max_tokens=1, prompt_logprobs=0), tenant=tenant)[0]
    lps = [next(iter(d.values())).logprob if len(d) == 1 else d[t].logprob
           for d, t in zip(out.prompt_logprobs[1:], ids[1:])]
    return float(torch.tensor(lps).neg().mean().exp())


def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(round(q * (len(s) - 1))))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--events", type=int, default=10)
    ap.add_argument("--samples", type=int, default=20)
    ap.add_argument("--context", choices=["frozen", "full"], default="full")
    ap.add_argument("--candidates", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--lr", type=float, default=1e-2)
    ap.add_argument("--ewc-lambda", type=float, default=InstantConfig.ewc_lambda,
                    help="EWC++ weight of the background loop's pull (0: off)")
    ap.add_argument("--ppl-tokens", type=int, default=1024)
    ap.add_argument("--quantization", default=None, help="the served model's (default: the engine's default)")
    ap.add_argument("--deep", type=float, default=None, metavar="MAX_PPL_INCREASE",
                    help="then run the deep loop for the consolidated tenant with this perplexity bar (0.01: the "
                         "issue's) and, if it promotes, measure again")
    ap.add_argument("--deep-ewc-lambda", type=float, default=None, help="the deep loop's EWC++ weight")
    args = ap.parse_args()

    from ruvllm import LLM, SamplingParams
    from ruvllm.learning.config import LearningConfig

    console = Console()
    llm = LLM(enable_lora=True, max_loras=4, max_lora_rank=8, max_cpu_loras=16,
              **({"quantization": args.quantization} if args.quantization else {}))
    with tempfile.TemporaryDirectory() as tmp:
        # no background thread: the benchmark runs the background loop's pass itself after each event,
        # as a server's loop does when events come further apart than its interval
        learner = llm.enable_learning(LearningConfig(
            instant=InstantConfig(layers=args.layers, lr=args.lr, context=args.context, candidates=args.candidates,
                                  ewc_lambda=args.ewc_lambda),
            root=tmp))
        text = NOVEL.read_text(encoding="utf-8")[50000:60000]
        ppl_ids = llm.tokenizer.encode(text)[:args.ppl_tokens]
        ppl_base = perplexity(llm, ppl_ids, "globex")
        before = hits(llm, QUESTION, "globex", args.samples)
        # two tenants taught alike: "instant" by the instant loop alone, "consolidated" with the
        # background loop's EWC++ pass after each event. The consolidated one goes first: a pass
        # consolidates every tenant with pending updates, and its timings must cover its own alone.
        columns = {"consolidated": True, "instant": False}
        results, figures, passes = {}, {}, []
        for tenant, consolidate in columns.items():
            # the tenant's everyday traffic before it teaches anything: what EWC++'s Fisher is made of
            llm.chat([[{"role": "user", "content": q}] for q in GENERAL],
                     SamplingParams(temperature=0, max_tokens=48), tenant=tenant)
            asked = llm.chat(QUESTION, SamplingParams(temperature=0, max_tokens=16), tenant=tenant)[0]
            console.print(f"{tenant}, before: {asked.outputs[0].text!r}")
            results[tenant] = []
            for _ in range(args.events):
                results[tenant].append(llm.feedback(asked.request_id, 1.0, CORRECTION, tenant=tenant))
                if consolidate:
                    t = time.perf_counter()
                    learner.consolidate()
                    passes.append((time.perf_counter() - t) * 1000)
            figures[tenant] = measure(llm, tenant, args.samples, ppl_ids, ppl_base)
            console.print(f"{tenant}, after: " + repr(llm.chat(QUESTION, SamplingParams(temperature=0, max_tokens=16),
                                                              tenant=tenant)[0].outputs[0].text))
        other = measure(llm, "globex", args.samples, ppl_ids, ppl_base)
        deep_rows = []
        if args.deep is not None:
            from ruvllm.learning.deep import DeepConfig

            novel = NOVEL.read_text(encoding="utf-8")
            heldout = llm.tokenizer.encode(novel[70000:73000])[:256]
            general = llm.tokenizer.encode(novel[20000:24000])[:512]
            fox = llm.tokenizer.encode("The quick brown fox jumps over the lazy")
            probes = [(fox, llm.generate([fox], SamplingParams(temperature=0, max_tokens=1))[0].outputs[0].token_ids)]
            c = learner.config.instant
            result = learner.deep_run("consolidated", heldout, probes, DeepConfig(
                rank=c.rank, alpha=c.alpha, targets=c.targets, layers=args.layers,
                max_perplexity_increase=args.deep,
                **({} if args.deep_ewc_lambda is None else {"ewc_lambda": args.deep_ewc_lambda})), general)
            checks = ", ".join(f"{k} {v:.4g}" for k, v in result.checks.items())
            deep_rows.append((f"deep loop (bar +{100 * args.deep:g}%): {result.steps} steps in {result.seconds:.0f} s",
                              "promoted" if result.passed else "refused: " + "; ".join(result.failed)))
            deep_rows.append(("deep loop checks", checks))
            if result.passed:
                deep_rows.append(("after promotion: question / paraphrase / perplexity",
                                  measure(llm, "consolidated", args.samples, ppl_ids, ppl_base)))

    table = Table(title=f"Teaching one fact: default model, {args.events} feedback events, micro-LoRA rank "
                        f"{learner.config.instant.rank} on {'/'.join(learner.config.instant.targets)} of the last "
                        f"{args.layers} layers, lr {args.lr:g}, EWC++ lambda {args.ewc_lambda:g}, context "
                        f"{args.context}, softmax {'full' if not args.candidates else f'sampled {args.candidates}'}; "
                        f"{torch.get_num_threads()} threads")
    table.add_column("what")
    for tenant in columns:
        table.add_column(f"{tenant} tenant")
    per = {t: [r.step_ms for r in rs] for t, rs in results.items()}
    rows = [("'Quenta' before (any tenant)", *[f"{before}/{args.samples}"] * 2),
            ("after: question / paraphrase / perplexity (base " + f"{ppl_base:.3f})", *figures.values()),
            ("another tenant after: question / paraphrase / perplexity", other, ""),
            ("update step p50 / p99 (forward, backward, Adam)",
             *[f"{pct(v, 0.5):.1f} / {pct(v, 0.99):.1f} ms" for v in per.values()]),
            ("loss, first -> last event", *[f"{rs[0].loss:.3f} -> {rs[-1].loss:.3f}" for rs in results.values()]),
            ("preparation, first event only (layers below)", *[f"{rs[0].prepare_ms:.1f} ms" for rs in results.values()]),
            ("publishing p50 (write PEFT folder, load, unload previous)",
             *[f"{statistics.median(r.publish_ms for r in rs):.1f} ms" for rs in results.values()]),
            ("background pass p50 / max (Fisher when due, pull, publish)", "-",
             f"{pct(passes, 0.5):.1f} / {max(passes):.1f} ms")]
    for r in rows + [(a, "", b) for a, b in deep_rows]:
        table.add_row(*r)
    console.print(table)


def measure(llm, tenant: str, samples: int, ppl_ids: list[int], ppl_base: float) -> str:
    ppl = perplexity(llm, ppl_ids, tenant)
    return (f"{hits(llm, QUESTION, tenant, samples)}/{samples} / {hits(llm, PARAPHRASE, tenant, samples)}/{samples} / "
            f"{ppl:.3f} ({100 * (ppl / ppl_base - 1):+.2f}%)")


if __name__ == "__main__":
    main()
