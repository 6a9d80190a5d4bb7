"""Multi-LoRA serving cost: 32 streams over 4 adapters vs the same 32 streams on the base model alone.

One engine on the embedded default model with LoRA enabled; N rank-R adapters on all seven
projections (random weights, written here in PEFT's format: adapter_config.json and
adapter_model.safetensors). The base and adapter runs alternate for --rounds rounds, which one goes
first alternating too, the prefix cache emptied before each run; each run's 128-token prompts come
from the novel, and each request generates exactly --gen-len tokens. Also reported: an adapter's
load time (read and check; the copy into a slot comes with its first step) on an idle engine, and
while --streams streams decode through the streaming engine (the core on its own thread, as
`ruvllm serve` runs it in its own process): the load's wall time and the longest gap between two
steps' outputs during it, against the longest decode step before it.

    COLUMNS=200 .venv/bin/python benchmarks/lora_throughput.py --streams 32 --adapters 4 --rank 16 --rounds 4
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
from offline_throughput import make_prompts  # noqa: E402

TARGETS = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
           "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}


def write_adapter(folder: Path, cfg, rank: int, seed: int, targets: tuple[str, ...] = tuple(TARGETS)) -> Path:
    """A PEFT-format LoRA adapter with random weights (B small, so outputs stay text-like)."""
    from ruvllm.lora.peft_adapter import projection_shape

    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(cfg.num_layers):
        for target in targets:
            sub = TARGETS[target]
            k, n = projection_shape(cfg, target)
            prefix = f"base_model.model.model.layers.{layer}.{sub}.{target}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, k, generator=g) / k ** 0.5
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(n, rank, generator=g) * 0.01
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(targets), "bias": "none"}))
    return folder


def run(llm, prompts: list[list[int]], adapters: list[str | None], gen_len: int) -> dict:
    from ruvllm import SamplingParams
    from ruvllm.messages import CoreRequest

    llm.reset_prefix_cache()
    params = SamplingParams(temperature=0, max_tokens=gen_len, ignore_eos=True)
    core = llm.core
    for i, (p, a) in enumerate(zip(prompts, adapters)):
        core.add_request(CoreRequest(f"r{time.perf_counter_ns()}-{i}", p, params, llm.eos_token_ids, adapter=a))
    start = time.perf_counter()
    total, longest = 0, 0.0
    while core.has_unfinished:
        t = time.perf_counter()
        outs = core.step()
        longest = max(longest, time.perf_counter() - t)
        total += sum(len(o.new_token_ids) for o in outs)
    elapsed = time.perf_counter() - start
    return {"tok_s": total / elapsed, "seconds": elapsed, "longest_step_ms": longest * 1000}


async def load_while_streaming(llm, prompts: list[list[int]], spares: list[Path], gen_len: int) -> list[dict]:
    """Start len(prompts) streams, wait until they all decode, load an adapter (the file read off the
    core's loop, the copy between two steps), and time the gaps between consecutive steps."""
    import asyncio

    from ruvllm import SamplingParams
    from ruvllm.outputs import OutputKind

    engine = llm.async_engine()
    params = SamplingParams(temperature=0, max_tokens=gen_len, ignore_eos=True)
    step_times: list[float] = []  # when each step's outputs arrived (one entry per distinct arrival)
    decoding = asyncio.Event()
    firsts = 0
    decode_from = 0  # the first step after every prompt's prefill

    async def stream(i: int, p: list[int]) -> None:
        nonlocal firsts, decode_from
        first = True
        async for _ in engine.generate(p, params, f"load-{i}", output_kind=OutputKind.DELTA):
            now = time.perf_counter()
            if not step_times or now - step_times[-1] > 1e-3:
                step_times.append(now)
            if first:
                first = False
                firsts += 1
                if firsts == len(prompts):
                    decode_from = len(step_times)
                    decoding.set()

    tasks = [asyncio.create_task(stream(i, p)) for i, p in enumerate(prompts)]
    await decoding.wait()
    await asyncio.sleep(1.0)  # a few steps of plain decoding to compare with
    gaps_before = [b - a for a, b in zip(step_times[decode_from:], step_times[decode_from + 1:])]
    results = []
    for i, spare in enumerate(spares):
        t0 = time.perf_counter()
        await asyncio.to_thread(engine.load_lora, f"during{i}", str(spare))
        t1 = time.perf_counter()
        window = [b - a for a, b in zip(step_times, step_times[1:]) if b >= t0 and a <= t1]
        results.append({"path": spare, "load_ms": (t1 - t0) * 1000, "gap_during_ms": max(window, default=0) * 1000,
                        "gap_before_ms": max(gaps_before, default=0) * 1000})
        await asyncio.sleep(0.5)
    await asyncio.gather(*tasks)
    engine.shutdown()
    for i in range(len(spares)):
        llm.unload_lora(f"during{i}")
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--streams", type=int, default=32)
    ap.add_argument("--adapters", type=int, default=4)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--gen-len", type=int, default=128)
    ap.add_argument("--threads", type=int, default=None, help="the engine's CPU threads (default: every core)")
    args = ap.parse_args()

    from ruvllm import LLM, SamplingParams

    console = Console()
    llm = LLM(enable_lora=True, max_loras=args.adapters + 1, max_cpu_loras=args.adapters + 2,
              max_lora_rank=args.rank, max_num_seqs=args.streams,
              max_num_batched_tokens=2048, num_threads=args.threads)
    cfg = llm.core.executor.model_config
    tmp = Path(tempfile.mkdtemp(prefix="lora-bench-"))
    names = []
    for i in range(args.adapters):
        write_adapter(tmp / f"a{i}", cfg, args.rank, seed=i)
        llm.load_lora(f"a{i}", tmp / f"a{i}")
        names.append(f"a{i}")
    spare = write_adapter(tmp / "spare", cfg, args.rank, seed=99)
    loads = []
    for _ in range(3):
        t = time.perf_counter()
        llm.load_lora("spare", spare)
        loads.append((time.perf_counter() - t) * 1000)
        llm.unload_lora("spare")
    size_mb = (spare / "adapter_model.safetensors").stat().st_size / 1e6

    prompts = make_prompts(llm.tokenizer, args.streams * (2 * args.rounds + 1), args.prompt_len)
    llm.generate(prompts[:1], SamplingParams(max_tokens=4), lora=names[0])  # warm-up
    base_rows, lora_rows, ratios = [], [], []
    for rnd in range(args.rounds):
        # which run goes first alternates, so a drift of the host's speed within a round favours neither
        chunks = (prompts[(2 * rnd + 1) * args.streams:(2 * rnd + 2) * args.streams],
                  prompts[(2 * rnd + 2) * args.streams:(2 * rnd + 3) * args.streams])
        adapters = [names[i % args.adapters] for i in range(args.streams)]
        order = ("base", "lora") if rnd % 2 == 0 else ("lora", "base")
        got = {}
        for which, chunk in zip(order, chunks):
            with console.status(f"round {rnd + 1}/{args.rounds}: {which}"):
                got[which] = run(llm, chunk, adapters if which == "lora" else [None] * args.streams, args.gen_len)
        b, lo = got["base"], got["lora"]
        base_rows.append(b)
        lora_rows.append(lo)
        ratios.append(lo["tok_s"] / b["tok_s"])

    table = Table(title=f"{args.streams} streams, {args.prompt_len}-token prompts, {args.gen_len} generated; "
                        f"{args.adapters} rank-{args.rank} adapters on all seven projections; medians of {args.rounds} rounds")
    for col in ("run", "output tok/s", "seconds", "longest step (ms)", "vs base (range)"):
        table.add_column(col, justify="right")
    med = lambda rows, k: statistics.median(r[k] for r in rows)  # noqa: E731
    table.add_row("base alone", f"{med(base_rows, 'tok_s'):.1f}", f"{med(base_rows, 'seconds'):.2f}",
                  f"{med(base_rows, 'longest_step_ms'):.0f}", "")
    table.add_row(f"{args.adapters} adapters", f"{med(lora_rows, 'tok_s'):.1f}", f"{med(lora_rows, 'seconds'):.2f}",
                  f"{med(lora_rows, 'longest_step_ms'):.0f}",
                  f"{statistics.median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f}x)")
    console.print(table)
    console.print(f"adapter load (read {size_mb:.1f} MB and check; the copy into a slot comes with its first step; idle engine): "
                  f"median {statistics.median(loads):.0f} ms of {', '.join(f'{x:.0f}' for x in loads)}")
    import asyncio

    small = write_adapter(tmp / "small", cfg, args.rank, seed=98, targets=("q_proj", "v_proj"))
    for d in asyncio.run(load_while_streaming(llm, prompts[:args.streams], [small, spare], args.gen_len)):
        mb = (d["path"] / "adapter_model.safetensors").stat().st_size / 1e6
        console.print(f"adapter load ({mb:.1f} MB) while {args.streams} streams decode: {d['load_ms']:.0f} ms; longest "
                      f"gap between two steps' outputs during it {d['gap_during_ms']:.0f} ms (longest decode step "
                      f"before: {d['gap_before_ms']:.0f} ms)")


if __name__ == "__main__":
    main()
