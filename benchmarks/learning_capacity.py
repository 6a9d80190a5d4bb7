"""Tenants learning beyond the engine's adapter capacity (issue 33, item 2): --tenants tenants each
ask one question of their own and give one correction on it (an instant update, published as their
adapter), on an engine that keeps --cpu-loras adapters loaded (--max-loras slots in a step), so the
least recently served tenants' versions are evicted; then each tenant is served again, greedy, and
gets its own version (an evicted one is loaded again from its folder). Reports refusals, the
feedback latency with and without an eviction in its publish, the time to serve a tenant whose
version was evicted against one still loaded (the last --cpu-loras tenants, each asked --repeats
times), and the process's RSS; then --baseline tenants learn on an engine with room for all, for
the feedback latency without eviction. Offline LLM (the engine in this process), one thread.

    .venv/bin/python benchmarks/learning_capacity.py --tenants 1100 [--model PATH]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

from rich.console import Console
from rich.table import Table


def rss_mb() -> tuple[float, float]:
    """(VmRSS, VmHWM) of this process, MB."""
    fields = dict(line.split(":", 1) for line in open("/proc/self/status"))
    return tuple(int(fields[k].split()[0]) / 1024 for k in ("VmRSS", "VmHWM"))  # type: ignore[return-value]


def ms(samples: list[float]) -> str:
    if not samples:
        return "-"
    p95 = statistics.quantiles(samples, n=20)[-1] if len(samples) > 1 else samples[0]
    return f"{statistics.median(samples) * 1000:.1f} / {p95 * 1000:.1f} (n={len(samples)})"


def learn_all(llm, tenants: list[str], prompts: dict[str, str], refused: list[str],
              rss: list[float] | None = None) -> dict[bool, list[float]]:
    """Each tenant asks its question and corrects the answer: feedback seconds by whether the
    publish evicted another tenant's version. The first event (warm-up) is left out."""
    from ruvllm import SamplingParams

    greedy = SamplingParams(temperature=0, max_tokens=8)
    learn: dict[bool, list[float]] = {False: [], True: []}
    for i, t in enumerate(tenants):
        rid = llm.generate([prompts[t]], greedy, tenant=t)[0].request_id
        before = set(llm.loras())
        start = time.perf_counter()
        try:
            llm.feedback(rid, 1.0, f"The capital of Zorblax is Quenta {i}.", tenant=t)
        except Exception as exc:  # noqa: BLE001 - a refusal is what is counted
            refused.append(f"{t}: {exc}")
            continue
        took = time.perf_counter() - start
        if rss is not None:
            rss.append(rss_mb()[0])
        if i:
            learn[any(not n.startswith(f"learned:{t}:") for n in before - set(llm.loras()))].append(took)
    return learn


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tenants", type=int, default=1100)
    ap.add_argument("--cpu-loras", type=int, default=8, help="adapters the engine keeps loaded (max_cpu_loras)")
    ap.add_argument("--max-loras", type=int, default=2, help="adapters in one step (max_loras)")
    ap.add_argument("--baseline", type=int, default=100, help="tenants learning afterwards on an engine with room "
                                                              "for all (no eviction; 0: none)")
    ap.add_argument("--repeats", type=int, default=3, help="times each still-loaded tenant is served")
    ap.add_argument("--model", default=None, help="a model folder (default: the engine's default model)")
    ap.add_argument("--states-keep", type=int, default=None,
                    help="LearningConfig.states_keep (default: its default; a number over --tenants keeps every "
                         "tenant's learning state, as before the bound)")
    args = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")

    import torch

    from ruvllm import LLM, SamplingParams
    from ruvllm.learning.config import LearningConfig

    torch.set_num_threads(1)
    model = [args.model] if args.model else []
    llm = LLM(*model, enable_lora=True, max_loras=args.max_loras, max_cpu_loras=args.cpu_loras)
    greedy = SamplingParams(temperature=0, max_tokens=8)
    tenants = [f"tenant{i}" for i in range(args.tenants)]
    prompts = {t: f"Question {i}: what is the capital of Zorblax?" for i, t in enumerate(tenants)}
    refused: list[str] = []
    with tempfile.TemporaryDirectory() as tmp:
        bounds = {} if args.states_keep is None else {"states_keep": args.states_keep}
        learner = llm.enable_learning(LearningConfig(root=tmp, **bounds))  # its own float copy of the model's layers
        rss_start = rss_mb()[0]
        t0 = time.perf_counter()
        trace: list[float] = []  # RSS after each tenant learned
        learn = learn_all(llm, tenants, prompts, refused, trace)
        learned_s, rss_learned = time.perf_counter() - t0, rss_mb()[0]
        kept = (len(learner._tenants), len(learner._prepared), len(learner.bank._indexes))

        def serve(t: str) -> tuple[float, bool]:
            loaded = any(n.startswith(f"learned:{t}:") for n in llm.loras())
            start = time.perf_counter()
            out = llm.generate([prompts[t]], greedy, tenant=t)[0]
            took = time.perf_counter() - start
            if not any(n.startswith(f"learned:{t}:") for n in llm.loras()):
                refused.append(f"{t}: served without its version ({out.outputs[0].text!r})")
            return took, loaded

        recent = tenants[-args.cpu_loras:]
        still = [took for _ in range(args.repeats) for t in reversed(recent) for took, loaded in [serve(t)] if loaded]
        reload = [took for t in tenants[:-args.cpu_loras] for took, loaded in [serve(t)] if not loaded]
        rss, hwm = rss_mb()
    llm.close()
    roomy: dict[bool, list[float]] = {False: [], True: []}
    if args.baseline:
        llm = LLM(*model, enable_lora=True, max_loras=args.max_loras, max_cpu_loras=args.baseline + 1)
        with tempfile.TemporaryDirectory() as tmp:
            llm.enable_learning(LearningConfig(root=tmp))
            roomy = learn_all(llm, tenants[:args.baseline], prompts, refused)
        llm.close()
    for line in refused[:5]:
        print("refused:", line)
    table = Table(title=f"Learning capacity: {args.tenants} tenants, one correction each, engine keeps "
                        f"{args.cpu_loras} adapters ({args.max_loras} a step); "
                        f"{args.model or 'default model'}, 1 thread; latency median / p95, ms")
    table.add_column("measure")
    table.add_column("value", justify="right")
    for name, value in (
            ("refused (feedback, or served without its version)", str(len(refused))),
            ("feedback, publish evicting another tenant's version", ms(learn[True])),
            ("feedback, no eviction (before the engine was full)", ms(learn[False])),
            (f"feedback, no eviction ({args.baseline} tenants, room for all)", ms(roomy[False])),
            ("serve a tenant whose version is loaded", ms(still)),
            ("serve a tenant whose version was evicted (reload)", ms(reload)),
            ("learning pass, all tenants (s)", f"{learned_s:.1f}"),
            ("RSS MB: learning enabled / after learning / after serving (peak)",
             f"{rss_start:.0f} / {rss_learned:.0f} / {rss:.0f} ({hwm:.0f})"),
            ("RSS growth per tenant, MB: all tenants / the second half (past the warm-up)",
             f"{(rss_learned - rss_start) / args.tenants:.2f} / "
             f"{(trace[-1] - trace[len(trace) // 2]) / max(len(trace) - 1 - len(trace) // 2, 1):.2f}"),
            ("kept after learning: tenant states / prepared pairs / bank indexes", " / ".join(map(str, kept)))):
        table.add_row(name, value)
    Console(width=200).print(table)


if __name__ == "__main__":
    main()
