"""`ruvllm benchmark`: latency and throughput of the engine itself, measured on EngineCore directly
(no asyncio, no HTTP) with greedy, fixed-length requests whose prompts are real text.

Each iteration runs one request alone (prefill latency = its time to first token, then its decode
rate), then `concurrency` requests submitted together (their times to first token and the aggregate
output rate). Prefix caching is off and every prompt is a different slice of text, so no iteration
is served from an earlier one's cache.
"""

from __future__ import annotations

import csv
import io
import json
import math
import resource
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer
from rich.table import Table

from ruvllm.cli.common import CliState, clean_errors, fail
from ruvllm.cli.engine_options import Flags, with_engine_flags
from ruvllm.config import CacheConfig

if TYPE_CHECKING:  # the engine imports torch: load it only once the command runs
    from ruvllm.core.engine_core import EngineCore
    from ruvllm.engine.llm import LLM

FORMATS = ("table", "json", "csv")
MODEL_HELP = ("Model path (GGUF file or Hugging Face folder), or a downloaded alias or Hub id; "
              "default: the embedded SmolLM2-135M-Instruct.")
CACHE_DIR_HELP = "Model cache for aliases and Hub ids (default: $RUVLLM_CACHE_DIR, else ~/.cache/ruvllm)."
BOOK_NAME = "pride-and-prejudice.txt"
# Used when the book is absent: ordinary prose, repeated as often as the prompts need.
FALLBACK_TEXT = (
    "The river ran slowly past the mill, carrying leaves and the occasional branch towards the town. "
    "In the mornings the baker opened his shutters early, and the smell of bread drifted across the "
    "square while the first carts rattled over the bridge. Nobody in the village could remember a "
    "time when the market had not been held on a Thursday, and nobody thought to ask why. "
)


@dataclass
class Settings:
    prompt_length: int
    gen_length: int
    concurrency: int
    warmup: int
    iterations: int

    def check(self) -> None:
        """Bad values fail here, before the model is loaded, with one line naming the flag."""
        for flag, value, least in (("--prompt-length", self.prompt_length, 1), ("--gen-length", self.gen_length, 2),
                                   ("--concurrency", self.concurrency, 1), ("--warmup", self.warmup, 0),
                                   ("--iterations", self.iterations, 1)):
            if value < least:
                # --gen-length >= 2: a decode rate needs at least one token after the first.
                raise fail(f"{flag} must be at least {least}, got {value}")


@dataclass
class Iteration:
    prefill_s: float  # one request alone: submit -> first token
    decode_tps: float  # one request alone: tokens after the first / time after the first
    ttfts_s: list[float] = field(default_factory=list)  # each of the concurrent requests
    aggregate_tps: float = 0.0  # concurrent: all output tokens / submit -> last finished


def find_book() -> Path | None:
    """../shared/data next to the checkout (or the current directory), if it is there."""
    roots = [Path.cwd(), Path(__file__).resolve().parents[3]]
    for root in roots:
        path = root.parent / "shared" / "data" / BOOK_NAME
        if path.is_file():
            return path
    return None


class PromptSource:
    """Distinct prompts of exactly `length` token ids, cut from consecutive stretches of real text."""

    def __init__(self, tokenizer: Any, length: int, text: str) -> None:
        # verbose=False: a text longer than the model's context is fine here, we only cut windows from it.
        ids = list(tokenizer.encode(text, add_special_tokens=False, verbose=False))
        while len(ids) < 2 * length:  # a short text is repeated until it yields a few windows
            ids += ids
        self.ids, self.length, self.next_start = ids, length, 0

    def take(self) -> list[int]:
        if self.next_start + self.length > len(self.ids):
            self.next_start = 0  # wrapped around: only after more prompts than the text holds
        start, self.next_start = self.next_start, self.next_start + self.length
        return self.ids[start:start + self.length]


def run_batch(core: EngineCore, prompts: list[list[int]], gen_length: int, tag: str) -> tuple[list[float], float, int]:
    """Submit all prompts at once and step to the end: (each request's TTFT, wall time, tokens generated)."""
    from ruvllm.messages import CoreRequest
    from ruvllm.sampling_params import SamplingParams
    params = SamplingParams(temperature=0, max_tokens=gen_length, ignore_eos=True)
    start = time.perf_counter()
    for i, ids in enumerate(prompts):
        core.add_request(CoreRequest(f"{tag}-{i}", ids, params))
    first: dict[str, float] = {}
    generated = 0
    while core.has_unfinished:
        outputs = core.step()
        now = time.perf_counter()
        for out in outputs:
            if out.request_id not in first and out.new_token_ids:
                first[out.request_id] = now - start
            generated += len(out.new_token_ids)
    wall = time.perf_counter() - start
    return [first[f"{tag}-{i}"] for i in range(len(prompts))], wall, generated


def run_iteration(core: EngineCore, prompts: PromptSource, s: Settings, tag: str) -> Iteration:
    (ttft,), wall, generated = run_batch(core, [prompts.take()], s.gen_length, f"{tag}-alone")
    it = Iteration(prefill_s=ttft, decode_tps=(generated - 1) / max(wall - ttft, 1e-9))
    it.ttfts_s, wall, generated = run_batch(core, [prompts.take() for _ in range(s.concurrency)],
                                            s.gen_length, f"{tag}-batch")
    it.aggregate_tps = generated / wall
    return it


def peak_memory_mib() -> float:
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / 2**20 if sys.platform == "darwin" else rss / 2**10  # bytes on macOS, KiB on Linux


def summarize(llm: LLM, s: Settings, dtype: str, source: str, its: list[Iteration]) -> dict[str, Any]:
    ttfts = [t for it in its for t in it.ttfts_s]
    info = llm.info
    return {
        "model": info.model, "dtype": dtype, "prompt_source": source,
        "quantization": info.quantization, "weight_mib": round(info.weight_bytes / 2**20, 1),
        "kv_cache_dtype": info.kv_cache_dtype,
        "prompt_length": s.prompt_length, "gen_length": s.gen_length, "concurrency": s.concurrency,
        "warmup": s.warmup, "iterations": s.iterations,
        "prefill_latency_ms": round(1000 * statistics.fmean(it.prefill_s for it in its), 3),
        "ttft_mean_ms": round(1000 * statistics.fmean(ttfts), 3),
        "ttft_p50_ms": round(1000 * statistics.median(ttfts), 3),
        "decode_tokens_per_s": round(statistics.fmean(it.decode_tps for it in its), 2),
        "aggregate_tokens_per_s": round(statistics.fmean(it.aggregate_tps for it in its), 2),
        "peak_memory_mib": round(peak_memory_mib(), 1),
        **speculation_report(llm),
    }


def speculation_report(llm: LLM) -> dict[str, Any]:
    """Speculative decoding's counters over the whole run (warm-up included), when it is on."""
    stats = llm.stats()
    if not stats.spec_verifications:
        return {}
    return {"spec_proposed_tokens": stats.spec_proposed, "spec_accepted_tokens": stats.spec_accepted,
            "spec_acceptance_rate": round(stats.spec_acceptance_rate, 4),
            "spec_mean_accepted_length": round(stats.spec_mean_accepted_length, 3)}


_LABELS = {
    "prefill_latency_ms": ("prefill latency (one request)", "ms"),
    "ttft_mean_ms": ("time to first token, mean", "ms"),
    "ttft_p50_ms": ("time to first token, p50", "ms"),
    "decode_tokens_per_s": ("decode, one stream", "tokens/s"),
    "aggregate_tokens_per_s": ("output, all streams", "tokens/s"),
    "peak_memory_mib": ("peak memory (max RSS)", "MiB"),
    "spec_proposed_tokens": ("speculation: tokens proposed", "tokens"),
    "spec_accepted_tokens": ("speculation: tokens accepted", "tokens"),
    "spec_acceptance_rate": ("speculation: acceptance rate", "ratio"),
    "spec_mean_accepted_length": ("speculation: tokens per verification", "tokens"),
}


def render(report: dict[str, Any], fmt: str, state: CliState) -> None:
    if fmt == "json":
        typer.echo(json.dumps(report, indent=2))
    elif fmt == "csv":
        buf = io.StringIO()
        writer = csv.DictWriter(buf, fieldnames=list(report), lineterminator="\n")
        writer.writeheader()
        writer.writerow(report)
        typer.echo(buf.getvalue(), nl=False)
    else:
        kv = f" · KV {report['kv_cache_dtype']}" if report["kv_cache_dtype"] != "auto" else ""
        table = Table(title=f"{Path(report['model']).name} · {report['dtype']} · {report['quantization']}{kv} · prompt {report['prompt_length']} · "
                            f"gen {report['gen_length']} · concurrency {report['concurrency']} · "
                            f"{report['iterations']} iteration(s)")
        table.add_column("metric")
        table.add_column("value", justify="right")
        table.add_column("unit")
        for key, (label, unit) in _LABELS.items():
            if key in report:
                value = report[key]
                table.add_row(label, f"{value:,.2f}" if isinstance(value, float) and value < 10 else f"{value:,.1f}", unit)
        state.console().print(table)


def benchmark(
    ctx: typer.Context,
    model: str | None = typer.Argument(None, metavar="MODEL", help=MODEL_HELP),
    warmup: int = typer.Option(1, "--warmup", help="Iterations run first and not counted."),
    iterations: int = typer.Option(3, "--iterations", help="Measured iterations (the report averages them)."),
    prompt_length: int = typer.Option(256, "--prompt-length", help="Prompt tokens per request."),
    gen_length: int = typer.Option(64, "--gen-length", help="Generated tokens per request (EOS ignored)."),
    concurrency: int = typer.Option(8, "--concurrency", help="Requests submitted together in the batch phase."),
    fmt: str = typer.Option("table", "--format", help="table, json or csv (json and csv: stdout only)."),
    cache_dir: str | None = typer.Option(None, "--cache-dir", help=CACHE_DIR_HELP),
    engine: Flags = None,  # type: ignore[assignment]  # the generated engine flags
) -> None:
    """Measure prefill latency, time to first token, decode and batch throughput, and peak memory."""
    state: CliState = ctx.obj or CliState()
    if fmt not in FORMATS:
        raise fail(f"--format must be one of {', '.join(FORMATS)}, got {fmt!r}")
    settings = Settings(prompt_length, gen_length, concurrency, warmup, iterations)
    settings.check()

    from ruvllm.engine.llm import LLM
    from ruvllm.device import resolve_device
    from ruvllm.loader.model_cache import resolve_cli_model

    block_size = CacheConfig().block_size
    # The KV pool holds exactly the batch phase, so nothing is preempted and peak memory reflects
    # this workload rather than the default 1 GiB pool.
    # Speculation's proposals take slots past a sequence's tokens (num_speculative_tokens more at most).
    lookahead = engine.to_config(None).speculation.num_lookahead
    blocks = concurrency * math.ceil((prompt_length + gen_length + lookahead) / block_size)
    device = resolve_device(engine.get("device") or "auto")  # a bad --device fails before any model is looked for
    path = resolve_cli_model(model, cache_dir)
    config = engine.to_config(path, num_blocks=blocks, max_num_seqs=concurrency)
    if config.cache.quantized_kv:
        # A two-tier pool keeps every sequence's hot window and one step's new tokens in 16-bit
        # besides the batch's tokens: size it as that hot tier plus the batch in 16-bit blocks.
        from ruvllm.worker.kv_sizing import hot_blocks_wanted

        sched = config.scheduler.resolved(device.type)
        hot, _ = hot_blocks_wanted(config.cache, sched, sched.token_budget)
        config = engine.to_config(path, num_blocks=blocks + hot, max_num_seqs=concurrency)
    err = state.console(stderr=True)
    with err.status("loading model…") as status:
        llm = LLM.from_config(config)
        if prompt_length + gen_length > llm.info.max_seq_len:
            raise fail(f"--prompt-length + --gen-length = {prompt_length + gen_length} exceeds the model's "
                       f"context of {llm.info.max_seq_len} tokens")
        book = find_book()
        text = book.read_text(encoding="utf-8") if book else FALLBACK_TEXT
        # Tokenize only about as much text as the run needs (English prose is ~4-5 characters a token).
        text = text[:8 * prompt_length * (warmup + iterations) * (1 + concurrency) + 4096]
        prompts = PromptSource(llm.tokenizer, prompt_length, text)
        measured: list[Iteration] = []
        for i in range(warmup + iterations):
            counted = i >= warmup
            status.update(f"iteration {i - warmup + 1}/{iterations}" if counted else f"warmup {i + 1}/{warmup}")
            it = run_iteration(llm.core, prompts, settings, f"it{i}")
            if counted:
                measured.append(it)
    render(summarize(llm, settings, llm.info.dtype, book.name if book else "built-in text", measured), fmt, state)


def register(app: typer.Typer) -> None:
    # The workload sizes the KV pool and the running cap; prefix caching is off so that every
    # iteration computes its prompts (turn it on with --prefix-caching).
    app.command("benchmark")(clean_errors(with_engine_flags(
        exclude=("num_blocks", "kv_cache_memory_bytes", "max_num_seqs"),
        defaults={"enable_prefix_caching": False})(benchmark)))
