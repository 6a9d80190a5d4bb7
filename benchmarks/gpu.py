"""GPU benchmark on random-weight models shaped like Llama-3.2-1B and Llama-3-8B (bf16, created on the device).

For each model, in one run:
  * batch-1 decode: tokens/s, and the share of the memory-bandwidth roofline it reaches
    (weight + KV bytes read per step / step time / copy bandwidth measured in this run), with each
    decode step launched ahead (async_scheduling, the default) and without, alternated;
  * time to first token of a 2,000-token prompt;
  * offline throughput: output tokens/s over N sequences with random input and output lengths
    in [100, 1024] (ignore_eos), and on the first M of them the same for transformers' `generate`
    (batches of sequences sorted by output length; a batch generates its longest output, and only
    the requested tokens are counted) beside ruvllm on exactly those M.

    python benchmarks/gpu.py [--models 1b 8b] [--num-seqs 256] [--hf-seqs 64] [--rounds 3] [--json OUT]
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import time
from dataclasses import dataclass

import torch

from ruvllm import SamplingParams
from ruvllm.config import CacheConfig, EngineConfig, ModelConfig, QuantConfig, SchedulerConfig
from ruvllm.core.engine_core import EngineCore
from ruvllm.messages import CoreRequest
from ruvllm.models.random_weights import random_weights
from ruvllm.worker.worker import Worker

LLAMA3_ROPE_1B = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 8192}
MODELS = {
    "1b": ("Llama-3.2-1B", ModelConfig("llama", 128256, 2048, 8192, 16, 32, 8, 64, 1e-5, 500000.0, 131072, True,
                                       rope_scaling=LLAMA3_ROPE_1B, eos_token_ids=(0,))),
    "8b": ("Llama-3-8B", ModelConfig("llama", 128256, 4096, 14336, 32, 32, 8, 128, 1e-5, 500000.0, 8192, False,
                                     eos_token_ids=(0,))),
}


@dataclass
class Row:
    model: str
    metric: str
    ruvllm: float
    transformers: float | None = None
    note: str = ""


def copy_bandwidth(device: str) -> float:
    """Bytes/s of a large device-to-device copy, counting bytes read and written."""
    src = torch.randn(2**28, device=device)  # 1 GiB
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    torch.cuda.synchronize()
    start = time.perf_counter()
    n = 20
    for _ in range(n):
        dst.copy_(src)
    torch.cuda.synchronize()
    bw = 2 * src.numel() * 4 * n / (time.perf_counter() - start)
    del src, dst
    return bw


def make_engine(cfg: ModelConfig, max_num_seqs: int, max_tokens: int, quantization: str = "auto") -> EngineCore:
    config = EngineConfig(device="cuda", dtype="bfloat16", max_model_len=4096,
                          quantization=QuantConfig(quantization, group_size=128),
                          cache=CacheConfig(gpu_memory_utilization=0.9),
                          scheduler=SchedulerConfig(max_num_batched_tokens=max_tokens, max_num_seqs=max_num_seqs))
    worker = Worker.from_weights(cfg, lambda dt: random_weights(cfg, dt, "cuda"), config, name="random")
    return EngineCore(worker, config)


def run_to_end(core: EngineCore, requests: list[tuple[list[int], int]], tag: str) -> tuple[float, dict[str, float]]:
    """Submit all, step until done. Returns the wall time and each request's first-token time."""
    start = time.perf_counter()
    for i, (prompt, out_len) in enumerate(requests):
        params = SamplingParams(max_tokens=out_len, temperature=0, ignore_eos=True)
        core.add_request(CoreRequest(f"{tag}{i}", prompt, params, core.info.eos_token_ids))
    first: dict[str, float] = {}
    while core.has_unfinished:
        for out in core.step():
            if out.request_id not in first and out.new_token_ids:
                first[out.request_id] = time.perf_counter() - start
    torch.cuda.synchronize()
    return time.perf_counter() - start, first


def decode_one(core: EngineCore, prompt_len: int, gen: int, vocab: int) -> tuple[float, float]:
    """Batch-1 decode: seconds per token after the first, and the mean context length."""
    prompt = [random.randrange(1, vocab) for _ in range(prompt_len)]
    params = SamplingParams(max_tokens=gen, temperature=0, ignore_eos=True)
    core.add_request(CoreRequest("solo", prompt, params, core.info.eos_token_ids))
    times = []
    while core.has_unfinished:
        core.step()
        times.append(time.perf_counter())
    per_token = (times[-1] - times[0]) / (len(times) - 1)
    return per_token, prompt_len + gen / 2


def graph_replay_seconds(core: EngineCore) -> float | None:
    """GPU time of the batch-1 decode graph (forward only), timed with CUDA events over many replays."""
    graphs = core.executor.runner.graphs  # type: ignore[attr-defined]  # the Worker's model runner
    if graphs is None:
        return None
    graphs.reset_inputs()  # padding rows only: the replays write nothing but the scratch block
    graph, _ = graphs.graphs[1]
    for _ in range(10):
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    n = 200
    for _ in range(n):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / n


def hf_throughput(name: str, cfg: ModelConfig, requests: list[tuple[list[int], int]], batch: int) -> float:
    from transformers import LlamaConfig, LlamaForCausalLM

    hf_cfg = LlamaConfig(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
                         intermediate_size=cfg.intermediate_size, num_hidden_layers=cfg.num_layers,
                         num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads,
                         head_dim=cfg.head_dim, rms_norm_eps=cfg.rms_norm_eps, rope_theta=cfg.rope_theta,
                         rope_scaling=cfg.rope_scaling, max_position_embeddings=cfg.max_position_embeddings,
                         tie_word_embeddings=cfg.tie_word_embeddings, pad_token_id=0, eos_token_id=0,
                         torch_dtype=torch.bfloat16)
    with torch.device("meta"):
        model = LlamaForCausalLM(hf_cfg)
    state = dict(random_weights(cfg, torch.bfloat16, "cuda"))
    model.load_state_dict(state, strict=False, assign=True)
    if cfg.tie_word_embeddings:
        model.tie_weights()
    model.model.rotary_emb = type(model.model.rotary_emb)(config=hf_cfg, device="cuda")
    model.eval()
    order = sorted(requests, key=lambda r: r[1])
    torch.cuda.synchronize()
    start = time.perf_counter()
    tokens = 0
    with torch.inference_mode():
        for i in range(0, len(order), batch):
            chunk = order[i:i + batch]
            width = max(len(p) for p, _ in chunk)
            ids = torch.tensor([[0] * (width - len(p)) + p for p, _ in chunk], device="cuda")
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p, _ in chunk], device="cuda")
            n = max(o for _, o in chunk)
            model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False)
            tokens += sum(o for _, o in chunk)
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    del model, state
    return tokens / elapsed


def bench_model(key: str, args: argparse.Namespace, bandwidth: float) -> list[Row]:
    name, cfg = MODELS[key]
    rows: list[Row] = []
    rng = random.Random(0)
    requests = [([rng.randrange(1, cfg.vocab_size) for _ in range(rng.randint(100, 1024))], rng.randint(100, 1024))
                for _ in range(args.num_seqs)]
    t0 = time.perf_counter()
    core = make_engine(cfg, args.max_num_seqs, args.max_num_batched_tokens, args.quantization)
    if args.quantization != "auto":
        name = f"{name} ({args.quantization} g128)"
    print(f"{name}: engine up in {time.perf_counter() - t0:.1f} s, {core.info.num_blocks} KV blocks, "
          f"weights {core.info.weight_bytes / 2**30:.2f} GiB", flush=True)

    decode_one(core, 128, 16, cfg.vocab_size)  # warm-up
    # Batch-1 decode with each step's graph launched ahead (the default) and without, alternated
    # round by round on the same engine (worker/cuda_graphs.py), medians.
    graphs = core.executor.runner.graphs  # type: ignore[attr-defined]
    arms = {"launched ahead": True, "one step at a time": False} if graphs is not None else {"eager": False}
    times: dict[str, list[float]] = {arm: [] for arm in arms}
    ctx = 0.0
    for _ in range(args.rounds):
        for arm, ahead in arms.items():
            if graphs is not None:
                graphs.ahead = ahead
            per_token, ctx = decode_one(core, 512, 256, cfg.vocab_size)
            times[arm].append(per_token)
    if graphs is not None:
        graphs.ahead = True
    kv_per_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 2
    bytes_per_step = core.info.weight_bytes + ctx * kv_per_token
    for arm, ts in times.items():
        per_token = sorted(ts)[len(ts) // 2]
        share = bytes_per_step / per_token / bandwidth
        rows.append(Row(name, f"batch-1 decode tok/s, {arm}", 1 / per_token,
                        note=f"{per_token * 1e3:.3f} ms/token (median of {len(ts)}: "
                             f"{', '.join(f'{t * 1e3:.3f}' for t in ts)}); {share:.0%} of roofline "
                             f"({bytes_per_step / 2**30:.2f} GiB/step at {bandwidth / 1e12:.2f} TB/s)"))
    replay = graph_replay_seconds(core)
    if replay is not None:
        rows.append(Row(name, "batch-1 forward on the GPU (us)", replay * 1e6,
                        note=f"the decode graph replayed alone; {bytes_per_step / replay / bandwidth:.0%} of "
                             "roofline; the rest of a step is host work (schedule, inputs, sampling)"))

    if args.decode_only:
        return rows
    ttft = []
    for i in range(3):
        prompt = [rng.randrange(1, cfg.vocab_size) for _ in range(2000)]
        _, first = run_to_end(core, [(prompt, 1)], f"ttft{i}-")
        ttft.append(next(iter(first.values())))
    rows.append(Row(name, "TTFT, 2000-token prompt (ms)", sorted(ttft)[1] * 1e3,
                    note=f"median of 3; token budget {args.max_num_batched_tokens}/step"))

    subset = requests[:args.hf_seqs]
    elapsed, _ = run_to_end(core, requests, "all")
    out_tokens = sum(o for _, o in requests)
    rows.append(Row(name, f"offline, {len(requests)} seqs: output tok/s", out_tokens / elapsed,
                    note=f"{out_tokens} tokens in {elapsed:.1f} s"))
    sub_rate = None
    if subset:
        elapsed, _ = run_to_end(core, subset, "sub")
        sub_rate = sum(o for _, o in subset) / elapsed
    del core
    gc.collect()
    torch.cuda.empty_cache()
    if subset and not args.skip_hf:
        hf_rate = hf_throughput(name, cfg, subset, args.hf_batch)
        rows.append(Row(name, f"offline, first {len(subset)} seqs: output tok/s", sub_rate, hf_rate,
                        note=f"transformers generate, batches of {args.hf_batch}"))
        gc.collect()
        torch.cuda.empty_cache()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", default=["1b", "8b"], choices=sorted(MODELS))
    ap.add_argument("--num-seqs", type=int, default=256)
    ap.add_argument("--hf-seqs", type=int, default=64)
    ap.add_argument("--hf-batch", type=int, default=32)
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--quantization", default="auto", help="weights: auto (dense bf16 on CUDA), int8, int4 (g128)")
    ap.add_argument("--decode-only", action="store_true", help="only the batch-1 decode rows")
    ap.add_argument("--rounds", type=int, default=3, help="batch-1 decode rounds of each arm, alternated")
    ap.add_argument("--json", default=None, help="also write the rows here")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/gpu.py needs a CUDA GPU")
    bandwidth = copy_bandwidth("cuda")
    print(f"{torch.cuda.get_device_name()}: copy bandwidth {bandwidth / 1e12:.2f} TB/s (read + write)", flush=True)
    rows: list[Row] = []
    for key in args.models:
        rows += bench_model(key, args, bandwidth)
        gc.collect()  # the engine's graphs and runner refer to each other: free its memory now
        torch.cuda.empty_cache()
    print("\n| model | metric | ruvllm | transformers | ratio | note |\n|---|---|---|---|---|---|")
    for r in rows:
        hf = f"{r.transformers:.1f}" if r.transformers else "-"
        ratio = f"{r.ruvllm / r.transformers:.2f}x" if r.transformers else "-"
        print(f"| {r.model} | {r.metric} | {r.ruvllm:.1f} | {hf} | {ratio} | {r.note} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump([r.__dict__ for r in rows], f, indent=1)


if __name__ == "__main__":
    main()
