"""Offline throughput: ruvllm vs transformers' generate on the same prompts and the same GGUF weights.

Each (engine, concurrency) cell runs in its own process so peak memory is that cell's alone.
An engine is `transformers` or `ruvllm[:QUANTIZATION][:kv=KV_CACHE_DTYPE]` (e.g. ruvllm:auto, the
default packed GGUF weights, ruvllm:none, dequantized, ruvllm:int8:kv=int8, int8 weights and a
two-tier int8 KV cache); ruvllm computes in --dtype, transformers in --hf-dtype. ruvllm rows also
report the decode rate (tokens after each sequence's first, over the time after the last first
token), the weights' bytes and the KV tokens its default 1 GiB pool holds.
Prompts are cut from a public-domain novel to exactly --prompt-len tokens; every request generates
exactly --gen-len tokens (ignore_eos). Prints a table; --json writes the rows.

    .venv/bin/python benchmarks/offline_throughput.py --engines ruvllm:auto ruvllm:none transformers
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

BOOK = Path(__file__).resolve().parents[2] / "shared" / "data" / "pride-and-prejudice.txt"


def make_prompts(tokenizer, n: int, length: int) -> list[list[int]]:
    text = BOOK.read_text(encoding="utf-8") if BOOK.exists() else "All work and no play makes Jack a dull boy. " * 5000
    ids = tokenizer.encode(text[20000:], add_special_tokens=False)
    return [ids[i * length * 3:i * length * 3 + length] for i in range(n)]


def run_ruvllm(n: int, prompt_len: int, gen_len: int, dtype: str, quantization: str = "auto",
               kv_cache_dtype: str = "auto") -> dict:
    from ruvllm import LLM, SamplingParams
    from ruvllm.messages import CoreRequest
    llm = LLM(dtype=dtype, quantization=quantization, max_num_seqs=max(n, 1), max_num_batched_tokens=2048,
              kv_cache_dtype=kv_cache_dtype)
    prompts = make_prompts(llm.tokenizer, n, prompt_len)
    params = SamplingParams(temperature=0, max_tokens=gen_len, ignore_eos=True)
    llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))  # warm-up
    core, info = llm.core, llm.info
    start = time.perf_counter()
    first: dict[str, float] = {}
    for i, p in enumerate(prompts):
        core.add_request(CoreRequest(f"b{i}", p, params, llm.eos_token_ids))
    total = 0
    while core.has_unfinished:
        for out in core.step():
            if out.request_id not in first:
                first[out.request_id] = time.perf_counter() - start
            total += len(out.new_token_ids)
    elapsed = time.perf_counter() - start
    last_first = max(first.values())
    return {"tokens": total, "seconds": elapsed, "ttft_s": sum(first.values()) / len(first),
            "decode_tok_s": (total - n) / (elapsed - last_first) if elapsed > last_first else None,
            "weight_mib": info.weight_bytes / 2**20, "kv_tokens": info.num_blocks * info.block_size}


def run_transformers(n: int, prompt_len: int, gen_len: int, dtype: str) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ruvllm.loader import default_model_path
    torch.set_num_threads(torch.get_num_threads())
    path = default_model_path()
    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, local_files_only=True,
                                                 dtype=getattr(torch, dtype)).eval()
    prompts = torch.tensor(make_prompts(tok, n, prompt_len))  # equal lengths: no padding needed
    mask = torch.ones_like(prompts)
    kw = dict(do_sample=False, pad_token_id=tok.eos_token_id, attention_mask=mask)
    with torch.inference_mode():
        model.generate(prompts[:1], max_new_tokens=4, min_new_tokens=4, **{**kw, "attention_mask": mask[:1]})
        t0 = time.perf_counter()
        model.generate(prompts, max_new_tokens=1, min_new_tokens=1, **kw)
        ttft = time.perf_counter() - t0
        t0 = time.perf_counter()
        out = model.generate(prompts, max_new_tokens=gen_len, min_new_tokens=gen_len, **kw)
        elapsed = time.perf_counter() - t0
    return {"tokens": int((out.shape[1] - prompt_len) * n), "seconds": elapsed, "ttft_s": ttft}


def child(args: argparse.Namespace) -> None:
    if args.engine.startswith("ruvllm"):
        parts = args.engine.split(":")[1:]
        kv = next((x.removeprefix("kv=") for x in parts if x.startswith("kv=")), "auto")
        quant = next((x for x in parts if not x.startswith("kv=")), "auto")
        row = run_ruvllm(args.n, args.prompt_len, args.gen_len, args.dtype, quant, kv)
    else:
        row = run_transformers(args.n, args.prompt_len, args.gen_len, args.hf_dtype)
    row["peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print("RESULT " + json.dumps(row))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--gen-len", type=int, default=128)
    ap.add_argument("--dtype", default="auto", help="ruvllm's dtype")
    ap.add_argument("--hf-dtype", default="float32", help="transformers' dtype")
    ap.add_argument("--engines", nargs="+", default=["ruvllm:auto", "ruvllm:none", "transformers"])
    ap.add_argument("--json", type=Path)
    ap.add_argument("--child", dest="engine", help=argparse.SUPPRESS)
    ap.add_argument("--n", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.engine:
        return child(args)

    rows = []
    console = Console()
    for n in args.concurrency:
        for engine in args.engines:
            cmd = [sys.executable, __file__, "--child", engine, "--n", str(n), "--prompt-len", str(args.prompt_len),
                   "--gen-len", str(args.gen_len), "--dtype", args.dtype, "--hf-dtype", args.hf_dtype]
            with console.status(f"{engine} at {n} sequences"):
                proc = subprocess.run(cmd, capture_output=True, text=True)
            line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
            if proc.returncode != 0 or not line:
                console.print(f"[red]{engine} at {n} failed:[/red]\n{proc.stderr[-2000:]}")
                continue
            row = json.loads(line[0][len("RESULT "):])
            row.update(engine=engine, concurrency=n, tok_s=row["tokens"] / row["seconds"])
            rows.append(row)

    table = Table(title=f"offline throughput: {args.prompt_len}-token prompts, {args.gen_len} generated; "
                        f"ruvllm dtype {args.dtype}, transformers {args.hf_dtype}")
    for col in ("engine", "seqs", "output tok/s", "decode tok/s", "TTFT mean (s)", "peak RSS (MiB)", "weights (MiB)",
                "KV tokens in 1 GiB", "ruvllm / transformers"):
        table.add_column(col, justify="right")
    by = {(r["engine"], r["concurrency"]): r for r in rows}
    for r in rows:
        ref = by.get(("transformers", r["concurrency"]))
        ratio = f"{r['tok_s'] / ref['tok_s']:.2f}x" if r["engine"].startswith("ruvllm") and ref else ""
        decode = f"{r['decode_tok_s']:.1f}" if r.get("decode_tok_s") else "-"
        weights = f"{r['weight_mib']:.1f}" if "weight_mib" in r else "-"
        kv_tokens = f"{r['kv_tokens']:,}" if "kv_tokens" in r else "-"
        table.add_row(r["engine"], str(r["concurrency"]), f"{r['tok_s']:.1f}", decode, f"{r['ttft_s']:.2f}",
                      f"{r['peak_rss_mib']:.0f}", weights, kv_tokens, ratio)
    console.print(table)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
