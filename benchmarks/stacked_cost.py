"""What stacking costs: 32 streams over named adapters alone vs the same streams with a tenant's
micro-LoRA stacked on each (docs/adapters.md, "Stacking").

One engine on the embedded default model with LoRA enabled; N rank-R adapters on all seven
projections (random, PEFT format, written by lora_throughput.py's `write_adapter`) and, per adapter,
a micro-LoRA of the learner's shape (rank 2 on v/o/down of the last 4 layers). The two runs
alternate for --rounds rounds (which goes first alternating too), the prefix cache emptied before
each; 128-token prompts from the novel, exactly --gen-len tokens generated each.

    COLUMNS=200 .venv/bin/python benchmarks/stacked_cost.py --streams 32 --adapters 4 --rank 16 --rounds 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parent))
from lora_throughput import TARGETS, write_adapter  # noqa: E402
from offline_throughput import make_prompts  # noqa: E402

MICRO_TARGETS = ("v_proj", "o_proj", "down_proj")  # learning/config.py's micro-LoRA


def write_micro(folder: Path, cfg, seed: int, layers: int = 4, rank: int = 2) -> Path:
    """A micro-LoRA as the learner publishes one: rank 2, alpha 4, on the last `layers` layers."""
    from ruvllm.lora.peft_adapter import projection_shape

    g = torch.Generator().manual_seed(seed)
    tensors = {}
    first = cfg.num_layers - layers
    for layer in range(first, cfg.num_layers):
        for target in MICRO_TARGETS:
            k, n = projection_shape(cfg, target)
            prefix = f"base_model.model.model.layers.{layer}.{TARGETS[target]}.{target}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, k, generator=g) / k ** 0.5
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(n, rank, generator=g) * 0.01
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(MICRO_TARGETS),
         "layers_to_transform": list(range(first, cfg.num_layers)), "bias": "none"}))
    return folder


def run(llm, prompts: list[list[int]], stacks: list[tuple[str, tuple[str, ...]]], gen_len: int) -> dict:
    from ruvllm import SamplingParams
    from ruvllm.messages import CoreRequest

    llm.reset_prefix_cache()
    params = SamplingParams(temperature=0, max_tokens=gen_len, ignore_eos=True)
    core = llm.core
    for i, (p, (adapter, stacked)) in enumerate(zip(prompts, stacks)):
        core.add_request(CoreRequest(f"r{time.perf_counter_ns()}-{i}", p, params, llm.eos_token_ids,
                                     adapter=adapter, stacked=stacked))
    start = time.perf_counter()
    total = 0
    while core.has_unfinished:
        total += sum(len(o.new_token_ids) for o in core.step())
    elapsed = time.perf_counter() - start
    return {"tok_s": total / elapsed, "seconds": elapsed}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--streams", type=int, default=32)
    ap.add_argument("--adapters", type=int, default=4)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--gen-len", type=int, default=128)
    args = ap.parse_args()

    from ruvllm import LLM

    console = Console()
    llm = LLM(enable_lora=True, max_loras=2 * args.adapters, max_cpu_loras=2 * args.adapters,
              max_lora_rank=args.rank, max_num_seqs=args.streams, max_num_batched_tokens=2048)
    cfg = llm.core.executor.model_config
    tmp = Path(tempfile.mkdtemp(prefix="stacked-bench-"))
    for i in range(args.adapters):
        llm.load_lora(f"a{i}", write_adapter(tmp / f"a{i}", cfg, args.rank, seed=i))
        llm.load_lora(f"m{i}", write_micro(tmp / f"m{i}", cfg, seed=100 + i))
    named = [(f"a{i % args.adapters}", ()) for i in range(args.streams)]
    stacked = [(a, (f"m{a[1:]}",)) for a, _ in named]
    prompts = make_prompts(llm.tokenizer, args.streams * (2 * args.rounds + 1), args.prompt_len)
    run(llm, prompts[:2], stacked[:2], 4)  # warm-up: every slot filled
    rows: dict[str, list[dict]] = {"named": [], "stacked": []}
    ratios = []
    for rnd in range(args.rounds):
        chunks = (prompts[(2 * rnd + 1) * args.streams:(2 * rnd + 2) * args.streams],
                  prompts[(2 * rnd + 2) * args.streams:(2 * rnd + 3) * args.streams])
        order = ("named", "stacked") if rnd % 2 == 0 else ("stacked", "named")
        got = {}
        for which, chunk in zip(order, chunks):
            with console.status(f"round {rnd + 1}/{args.rounds}: {which}"):
                got[which] = run(llm, chunk, named if which == "named" else stacked, args.gen_len)
            rows[which].append(got[which])
        ratios.append(got["stacked"]["tok_s"] / got["named"]["tok_s"])
        console.print(f"round {rnd + 1}: named {got['named']['tok_s']:.1f} tok/s, stacked "
                      f"{got['stacked']['tok_s']:.1f} tok/s ({ratios[-1]:.2f}x)")

    table = Table(title=f"{args.streams} streams, {args.prompt_len}-token prompts, {args.gen_len} generated; "
                        f"{args.adapters} rank-{args.rank} adapters on all seven projections, each with a rank-2 "
                        f"micro-LoRA (v/o/down, last 4 layers) stacked or not; medians of {args.rounds} rounds")
    for col in ("run", "output tok/s", "seconds", "vs named alone (range)"):
        table.add_column(col, justify="right")
    for which in ("named", "stacked"):
        table.add_row(which, f"{statistics.median(r['tok_s'] for r in rows[which]):.1f}",
                      f"{statistics.median(r['seconds'] for r in rows[which]):.2f}",
                      "" if which == "named" else
                      f"{statistics.median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f}x)")
    console.print(table)


if __name__ == "__main__":
    main()
