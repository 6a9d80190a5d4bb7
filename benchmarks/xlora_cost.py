"""What an X-LoRA step costs, piece by piece, against the same step on the base model.

The embedded default model (default precision), an X-LoRA model over --adapters rank-R adapters on
all seven projections (random weights) with a --depth x --size classifier (random, written in
peft's format). For decode batches of 1 and --streams sequences at a --context-token context, and
for one --prefill-token prompt, the median over --repeats of:

  base      the step's forward pass on the base model alone (the C++ layer loop)
  scaling   the X-LoRA scaling pass: the same forward over the scaling KV stream (the base model)
  classify  the classifier and the per-row mixing weights built from its scalings
  real      the real pass: the forward with every row mixing the adapters (the Python layer loop)

The issue's bound is on scaling + classify over base (<= 1.2x).

    COLUMNS=200 .venv/bin/python benchmarks/xlora_cost.py --streams 32 --repeats 9
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
from lora_throughput import write_adapter  # noqa: E402


def write_xlora(folder: Path, adapters: list[Path], hidden: int, depth: int, size: int, seed: int) -> Path:
    """An X-LoRA checkpoint as peft's loader reads it: adapter_config.json naming the adapters, and
    the classifier (random) in adapter_model.safetensors."""
    g = torch.Generator().manual_seed(seed)
    widths = [hidden] + [size] * (depth - 1) + [len(adapters)]
    tensors = {}
    for i in range(depth):
        key = f"base_model.internal_xlora_classifier.layers.{3 * i}"
        tensors[f"{key}.weight"] = torch.randn(widths[i + 1], widths[i], generator=g) / widths[i] ** 0.5
        tensors[f"{key}.bias"] = torch.zeros(widths[i + 1])
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(json.dumps({
        "peft_type": "XLORA", "task_type": "CAUSAL_LM", "hidden_size": hidden, "xlora_depth": depth,
        "xlora_size": size, "xlora_dropout_p": 0.2, "adapters": {str(i): str(p) for i, p in enumerate(adapters)}}))
    return folder


def timed(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def measure(llm, n_seqs: int, context: int, new_tokens: int, repeats: int) -> dict[str, float]:
    """Prefill `n_seqs` X-LoRA sequences of `context` tokens, then time steps of `new_tokens` each."""
    from ruvllm.outputs import ScheduledSeq, SchedulerOutput
    from ruvllm.request import Request, scaling_key
    from ruvllm.sampling_params import SamplingParams

    kv, runner = llm.core.kv, llm.core.executor.runner
    g = torch.Generator().manual_seed(n_seqs)
    reqs = []
    for i in range(n_seqs):
        req = Request(f"r{i}", torch.randint(100, 40000, (context + new_tokens,), generator=g).tolist(), SamplingParams())
        req.scaling_pass = True
        assert kv.allocate_slots(req, context + new_tokens), "grow the KV pool"
        reqs.append(req)

    def seqs(start: int, n: int, adapter: str | None) -> SchedulerOutput:
        return SchedulerOutput([ScheduledSeq(r.request_id, r.prompt_token_ids[start:start + n], start,
                                             kv.block_table(r.request_id), sample=False, adapter=adapter,
                                             scaling_block_table=kv.block_table(scaling_key(r.request_id))
                                             if adapter else None) for r in reqs])

    if context:
        with torch.inference_mode():
            runner.forward(seqs(0, context, "x"))  # both KV streams hold the context
    step = seqs(context, new_tokens, "x")
    base_step = seqs(context, new_tokens, None)
    manager = runner.lora
    pieces: dict[str, float] = {}
    with torch.inference_mode():
        manager.batch(step)  # the experts resident
        pieces["base"] = timed(lambda: runner._forward(base_step.seqs, None, scaling_tables=False), repeats)
        pieces["scaling"] = timed(lambda: runner._forward(step.seqs, None, scaling_tables=True), repeats)
        hidden = runner._forward(step.seqs, None, scaling_tables=True)
        pieces["classify"] = timed(lambda: manager.xlora_batch(step.seqs, hidden), repeats)
        xb = manager.xlora_batch(step.seqs, hidden)
        pieces["real"] = timed(lambda: runner._forward(step.seqs, xb, scaling_tables=False), repeats)
    for r in reqs:
        kv.free(r)
    return pieces


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--streams", type=int, default=32)
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--prefill", type=int, default=512)
    ap.add_argument("--adapters", type=int, default=3)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--depth", type=int, default=2)
    ap.add_argument("--size", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=9)
    args = ap.parse_args()

    from ruvllm import LLM

    llm = LLM(enable_lora=True, max_loras=args.adapters, max_lora_rank=args.rank, num_blocks=1024)
    cfg = llm.core.executor.model_config
    with tempfile.TemporaryDirectory() as tmp:
        folders = [write_adapter(Path(tmp) / f"a{i}", cfg, args.rank, seed=i) for i in range(args.adapters)]
        llm.load_lora("x", write_xlora(Path(tmp) / "x", folders, cfg.hidden_size, args.depth, args.size, seed=99))
        cases = [(f"decode, 1 stream, ctx {args.context}", 1, args.context, 1),
                 (f"decode, {args.streams} streams, ctx {args.context}", args.streams, args.context, 1),
                 (f"prefill, {args.prefill} tokens", 1, 0, args.prefill)]
        table = Table(title=f"X-LoRA step pieces (ms, median of {args.repeats}): default model, {args.adapters} "
                            f"rank-{args.rank} adapters on 7 projections, classifier {args.depth} x {args.size}, "
                            f"{torch.get_num_threads()} threads")
        for col in ("case", "base", "scaling", "classify", "real", "scaling+classify / base", "whole step / base"):
            table.add_column(col, justify="right")
        for name, n, ctx, new in cases:
            p = measure(llm, n, ctx, new, args.repeats)
            ms = {k: 1000 * v for k, v in p.items()}
            table.add_row(name, *(f"{ms[k]:.2f}" for k in ("base", "scaling", "classify", "real")),
                          f"{(ms['scaling'] + ms['classify']) / ms['base']:.2f}x",
                          f"{(ms['scaling'] + ms['classify'] + ms['real']) / ms['base']:.2f}x")
        Console().print(table)


if __name__ == "__main__":
    main()
