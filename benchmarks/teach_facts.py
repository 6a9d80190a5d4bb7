"""Teach the default model several made-up facts through feedback, one tenant each, and measure
how well each holds under sampling (issue 37: learning that holds for any fact).

For each fact of the file (default benchmarks/data/heldout_facts.json, which no tuning run reads):
a fresh tenant first asks four everyday questions (its own traffic, what EWC++'s Fisher is made
of), then the fact's question (greedy); then --events feedback events `{"id", "score": -1,
"correction"}` on that completion go through the path the server's POST /v1/feedback takes
(GenerationService.feedback -> Learner.feedback), each followed by the background loop's pass (as
`ruvllm serve --learn` runs it while updates are pending). Then --samples answers at T=0.7 to the
question, --samples to the paraphrases (round robin), and --samples of another tenant, which never
learns, to the question; perplexity on 1,024 tokens of the novel for the taught tenant against the
base. A sample states the fact when one of the fact's `match` regexes is found in it.

Per fact it also prints why it did or did not hold: the loss the events reported, the full-softmax
per-token loss of the correction after teaching (its worst token), the steps taken, the learned
change per layer (|scaling * B A|, Frobenius, summed over targets) and how much of the distance
from the base the background loop's pulls kept.

    nice -n 5 .venv/bin/python benchmarks/teach_facts.py                    # the held-out facts
    nice -n 5 .venv/bin/python benchmarks/teach_facts.py --facts benchmarks/data/tuning_facts.json --samples 8
"""

from __future__ import annotations

import argparse
import datetime
import json
import re
import statistics
import tempfile
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from ruvllm.learning.config import InstantConfig

HERE = Path(__file__).resolve().parent
GENERAL = ["Write two sentences about the sea.", "What is a good way to learn a new language?",
           "Summarise the plot of a love story in three sentences.", "Give me a tip for cooking rice."]
NOVEL = HERE.parents[1] / "shared" / "data" / "pride-and-prejudice.txt"
OTHER = "bystander"


def user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def count(llm, prompts: list[str], tenant: str, n: int, patterns: list[re.Pattern], max_tokens: int) -> tuple[int, str]:
    """Samples at T=0.7 (n, spread round robin over the prompts) stating the fact, and one of them."""
    from ruvllm import SamplingParams

    convs = [user(prompts[i % len(prompts)]) for i in range(n)]
    outs = llm.chat(convs, SamplingParams(temperature=0.7, max_tokens=max_tokens, seed=None), tenant=tenant)
    texts = [o.outputs[0].text for o in outs]
    return sum(any(p.search(t.strip()) for p in patterns) for t in texts), texts[0]


def perplexity(llm, ids: list[int], tenant: str) -> float:
    from ruvllm import SamplingParams

    out = llm.generate([ids], SamplingParams(max_tokens=1, prompt_logprobs=0), tenant=tenant)[0]
    lps = [next(iter(d.values())).logprob if len(d) == 1 else d[t].logprob
           for d, t in zip(out.prompt_logprobs[1:], ids[1:])]
    return float(torch.tensor(lps).neg().mean().exp())


def diagnose(learner, tenant: str, prompt: list[int], target: list[int]) -> dict:
    """Full-softmax per-token loss of the target under the tenant's micro-LoRA, and its learned change per layer."""
    state = learner._tenants[tenant]
    prep = learner.instant.prepare(prompt, target, "full")
    with torch.no_grad():
        out = learner.layers.forward(prep.h, torch.arange(len(prompt) + len(target)), state.lora)
        logp = (out[len(prompt) - 1:-1] @ learner.layers.head.t()).log_softmax(-1)
        nll = -logp.gather(1, torch.tensor(target)[:, None]).squeeze(1)
        per_layer: dict[int, float] = {}
        for (layer, _), (a, b) in state.lora.weights.items():
            per_layer[layer] = per_layer.get(layer, 0.0) + float((b @ a).norm() * state.lora.scaling)
    worst = int(nll.argmax())
    return {"nll_mean": float(nll.mean()), "nll_max": float(nll.max()),
            "worst": learner.tokenizer.decode([target[worst]]), "steps": state.steps, "per_layer": per_layer}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--facts", default=str(HERE / "data" / "heldout_facts.json"))
    ap.add_argument("--only", type=int, nargs="*", help="indices of the facts to run (default: all)")
    ap.add_argument("--events", type=int, default=10)
    ap.add_argument("--samples", type=int, default=20)
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--ppl-tokens", type=int, default=1024)
    ap.add_argument("--no-consolidate", action="store_true", help="no background pass after each event")
    ap.add_argument("--label", default="", help="a name for this run's method, printed with its table")
    ap.add_argument("--json", default=None, help="also write the per-fact figures here")
    # the instant step's settings (default: InstantConfig's)
    defaults = InstantConfig()
    for name in ("layers", "rank", "alpha", "lr", "candidates", "ewc_lambda", "steps_per_event", "target_nll",
                 "hard_negatives", "estimate_rest", "kl_weight", "kl_samples", "kl_top", "fisher_samples", "system_prompt",
                 "question_forms"):
        value = getattr(defaults, name)
        kind = (lambda v: v.lower() in ("1", "true", "yes")) if isinstance(value, bool) else type(value)
        ap.add_argument("--" + name.replace("_", "-"), type=kind, default=value)
    ap.add_argument("--context", choices=["frozen", "full"], default=defaults.context)
    ap.add_argument("--backward", choices=["int8", "float32"], default=defaults.backward)
    args = ap.parse_args()

    from ruvllm import LLM, SamplingParams
    from ruvllm.learning.config import LearningConfig

    facts = json.loads(Path(args.facts).read_text())["facts"]
    chosen = range(len(facts)) if args.only is None else args.only
    instant = InstantConfig(**{k: getattr(args, k) for k in InstantConfig.__dataclass_fields__
                               if hasattr(args, k) and k not in ("targets", "seed")})
    console = Console()
    llm = LLM(enable_lora=True, max_loras=4, max_lora_rank=8, max_cpu_loras=32)
    rows, dumps = [], []
    with tempfile.TemporaryDirectory() as tmp:
        learner = llm.enable_learning(LearningConfig(instant=instant, root=tmp))
        text = NOVEL.read_text(encoding="utf-8")[50000:60000]
        ppl_ids = llm.tokenizer.encode(text)[:args.ppl_tokens]
        ppl_base = perplexity(llm, ppl_ids, OTHER)
        for i in chosen:
            fact = facts[i]
            patterns = [re.compile(p, re.I) for p in fact["match"]]
            tenant = f"fact{i}"
            llm.chat([user(q) for q in GENERAL], SamplingParams(temperature=0, max_tokens=48), tenant=tenant)
            asked = llm.chat(user(fact["question"]), SamplingParams(temperature=0, max_tokens=args.max_tokens),
                             tenant=tenant)[0]
            results, passes = [], []
            for _ in range(args.events):
                results.append(llm.feedback(asked.request_id, -1.0, fact["correction"], tenant=tenant))
                if not args.no_consolidate:
                    t = time.perf_counter()
                    learner.consolidate()
                    passes.append((time.perf_counter() - t) * 1000)
            target = llm.tokenizer.encode(fact["correction"], add_special_tokens=False) + [learner.eos]
            diag = diagnose(learner, tenant, list(asked.prompt_token_ids), target)
            kept = [v.checks["kept"] for v in learner.policy.versions(tenant) if "kept" in v.checks]
            greedy = llm.chat(user(fact["question"]), SamplingParams(temperature=0, max_tokens=args.max_tokens),
                              tenant=tenant)[0].outputs[0].text
            q, q_text = count(llm, [fact["question"]], tenant, args.samples, patterns, args.max_tokens)
            p, p_text = count(llm, fact["paraphrases"], tenant, args.samples, patterns, args.max_tokens)
            o, _ = count(llm, [fact["question"]], OTHER, args.samples, patterns, args.max_tokens)
            ppl = perplexity(llm, ppl_ids, tenant)
            fig = {"fact": i, "shape": fact["shape"], "question": q, "paraphrase": p, "other": o,
                   "ppl_pct": 100 * (ppl / ppl_base - 1), "loss_first": results[0].loss, "loss_last": results[-1].loss,
                   "step_ms": statistics.median(r.step_ms for r in results), "kept_min": min(kept, default=1.0),
                   "greedy_before": asked.outputs[0].text, "greedy_after": greedy, "sample_q": q_text,
                   "sample_p": p_text, **diag}
            dumps.append(fig)
            console.print(f"[{fact['shape']}] before {fig['greedy_before']!r} -> after {greedy!r}; "
                          f"q {q}/{args.samples} p {p}/{args.samples} other {o}/{args.samples} ppl {fig['ppl_pct']:+.2f}% "
                          f"nll mean {diag['nll_mean']:.3f} max {diag['nll_max']:.3f} ({diag['worst']!r}) "
                          f"steps {diag['steps']} kept {fig['kept_min']:.3f} layers "
                          + " ".join(f"{k}:{v:.3f}" for k, v in diag["per_layer"].items()), markup=False)
            rows.append(fig)

    c = instant
    table = Table(title=f"{args.label or 'method'}: {len(rows)} facts ({Path(args.facts).name}), {args.events} "
                        f"corrections each, {args.samples} samples at T=0.7; rank {c.rank} alpha {c.alpha:g} on the last "
                        f"{c.layers} layers, lr {c.lr:g}, EWC++ lambda {c.ewc_lambda:g}"
                        + "".join(f", {k} {getattr(c, k)}" for k in ("candidates", "hard_negatives", "estimate_rest",
                                                                         "steps_per_event", "target_nll", "kl_weight",
                                                                         "kl_samples", "fisher_samples"))
                        + f"; {datetime.date.today()}")
    for col in ("fact", "question", "paraphrase", "other tenant", "perplexity", "loss first -> last",
                "after: NLL mean / worst token", "steps", "EWC kept (min)", "step p50"):
        table.add_column(col)
    n = args.samples
    for f in rows:
        table.add_row(f["shape"], f"{f['question']}/{n}", f"{f['paraphrase']}/{n}", f"{f['other']}/{n}",
                      f"{f['ppl_pct']:+.2f}%", f"{f['loss_first']:.3f} -> {f['loss_last']:.3f}",
                      f"{f['nll_mean']:.3f} / {f['nll_max']:.3f} {f['worst']!r}", str(f["steps"]),
                      f"{f['kept_min']:.3f}", f"{f['step_ms']:.1f} ms")
    med = {k: statistics.median(f[k] for f in rows) for k in ("question", "paraphrase", "other", "ppl_pct", "step_ms")}
    table.add_row("median", f"{med['question']:g}/{n}", f"{med['paraphrase']:g}/{n}", f"{med['other']:g}/{n}",
                  f"{med['ppl_pct']:+.2f}%", "", "", "", "", f"{med['step_ms']:.1f} ms")
    console.print(table)
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "facts": dumps, "median": med}, indent=1))


if __name__ == "__main__":
    main()
