"""Our CPU paged attention (attention/csrc/paged_attention.cpp, its fp32 path: the default on this
CPU) on a prompt's chunks and on batched decodes, for the heads of real models, and with
--compare-with, against the kernel's source at a git revision built alone: the two take turns call
by call, round after round, and their bits are checked equal on every case.

    .venv/bin/python benchmarks/paged_attention.py --threads 1 --rounds 5 --compare-with HEAD~1

Cases: "prefill N": one sequence's N prompt rows in one call, each seeing the keys up to itself; "chunk
R at C": R rows at the end of a C-token context (a chunked prefill's later chunk); "decode B x C": B
sequences' one row each at C tokens of context. Heads (query / KV, head size): SmolLM2-135M 9/3 x 64,
Llama-3.2-1B 32/8 x 64, Gemma 3 270M 4/1 x 256. Cells: ms a call (median of the rounds' best calls).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

import kernel_at  # noqa: E402
from ruvllm.attention.cpu_kernels import paged_attention  # noqa: E402

SOURCE = Path("src/ruvllm/attention/csrc/paged_attention.cpp")
DECLARATION = ("at::Tensor paged_attention(at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, "
               "int64_t, double, int64_t)")
SCHEMA = ("paged_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor row_seq, "
          "Tensor row_ctx, int block_size, float scale, int window=0) -> Tensor")
HEADS = {"smollm2-135m": (9, 3, 64), "llama-3.2-1b": (32, 8, 64), "gemma3-270m": (4, 1, 256)}
CASES = {"prefill 512": (1, 512, 512), "chunk 256 at 2048": (1, 256, 2048), "decode 16 x 1024": (16, 1, 1024)}
BLOCK = 16


def step(heads: tuple[int, int, int], seqs: int, rows: int, ctx: int, gen: torch.Generator):
    """A paged cache holding `seqs` sequences of `ctx` tokens (their blocks shuffled) and each one's
    last `rows` query rows: the kernel's arguments after the scale."""
    hq, hkv, dim = heads
    per = (ctx + BLOCK - 1) // BLOCK
    blocks = torch.randperm(seqs * per, generator=gen)
    cache = [torch.randn(seqs * per * BLOCK, hkv, dim, generator=gen) for _ in range(2)]
    tables = blocks.view(seqs, per)
    row_seq = torch.arange(seqs).repeat_interleave(rows)
    row_ctx = torch.arange(ctx - rows + 1, ctx + 1).repeat(seqs)
    q = torch.randn(seqs * rows, hq, dim, generator=gen)
    return q, cache[0], cache[1], tables, row_seq, row_ctx, BLOCK, dim ** -0.5


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    kernel_at.add_arguments(p)
    p.add_argument("--models", nargs="+", default=list(HEADS), choices=list(HEADS))
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    tree = paged_attention()
    if tree is None:
        raise SystemExit("the C++ kernels cannot be built here")
    fns = {"tree": tree}
    if args.compare_with:
        fns = {args.compare_with: kernel_at.standalone(kernel_at.source_at(args.compare_with, SOURCE),
                                                       "paged_attention", DECLARATION, SCHEMA), **fns}
    gen = torch.Generator().manual_seed(0)
    steps = {(m, c): step(HEADS[m], *CASES[c], gen) for m in args.models for c in CASES}
    if args.compare_with:
        same = all(torch.equal(*(fn(*a) for fn in fns.values())) for a in steps.values())
        print(f"bitwise equal to {args.compare_with} on every case: {same}")
    times: dict[tuple, list[float]] = {}
    load = []
    for _ in range(args.rounds):
        for key, a in steps.items():
            for name, fn in fns.items():
                times.setdefault((name, *key), []).append(kernel_at.best_of(lambda: fn(*a), args.budget))
        load.append(float(Path("/proc/loadavg").read_text().split()[0]))
    names = list(fns)
    print("| model | case | " + " | ".join(f"{n}: ms" for n in names) + (" | tree / " + names[0] + " |" if len(names) == 2 else " |"))
    print("|" + "---|" * (2 + len(names) + (len(names) == 2)))
    for m, c in steps:
        med = [statistics.median(times[(n, m, c)]) for n in names]
        ratio = f" {med[1] / med[0]:.2f} |" if len(names) == 2 else ""
        print(f"| {m} | {c} | " + " | ".join(f"{v * 1e3:.3f}" for v in med) + " |" + ratio)
    print(f"threads {args.threads}, rounds {args.rounds}, 1-min load average after each round: {load}")


if __name__ == "__main__":
    main()
