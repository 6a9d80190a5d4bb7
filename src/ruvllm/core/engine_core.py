"""The engine loop's body: add and abort requests, and step() = schedule, run once for all, update."""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ruvllm.config import CacheConfig, EngineConfig, ModelConfig, QuantConfig, SchedulerConfig
from ruvllm.core.kv_cache_manager import KVCacheManager
from ruvllm.core.scheduler import Scheduler
from ruvllm.device import resolve_device
from ruvllm.dtypes import resolve_model_dtype
from ruvllm.engine.detokenizer import IncrementalDetokenizer
from ruvllm.errors import RequestError
from ruvllm.loader import iter_weights, load_model_config, load_tokenizer, resolve_model
from ruvllm.models.registry import build_model, weight_bytes
from ruvllm.quant.plan import quantization_for_device, quantizes_weights
from ruvllm.outputs import CompletionOutput, RequestOutput, SchedulerOutput
from ruvllm.request import ArrivalCounter, FinishReason, Priority, Request
from ruvllm.sampling_params import SamplingParams
from ruvllm.worker.gpu_memory import check_weights_fit, kv_blocks_from_profile, profile_step_memory
from ruvllm.attention.kv_quant import check_kv_cache_dtype
from ruvllm.worker.model_runner import ModelRunner, kv_bytes_per_block, kv_tier_blocks

log = logging.getLogger(__name__)


@dataclass
class _Group:
    """A user request: its n completions share a prompt."""

    request_id: str
    prompt_token_ids: list[int]
    children: list[Request]
    detoks: list[IncrementalDetokenizer]
    prompt: str | None = None
    finished: bool = False


class EngineCore:
    def __init__(self, config: EngineConfig | None = None) -> None:
        config = config or EngineConfig()
        src = resolve_model(config.model)
        self._load(config, load_model_config(src), load_tokenizer(src), src.path,
                   lambda dtype, quant: iter_weights(src, dtype, keep_quantized=quantizes_weights(quant, dtype)))

    @classmethod
    def from_weights(cls, model_config: ModelConfig, weights: Callable[[torch.dtype], Iterable[tuple[str, Any]]],
                     tokenizer: Any, config: EngineConfig, name: str = "in-memory") -> EngineCore:
        """An engine over weights that come from code rather than a file (benchmarks on random
        models shaped like large ones): `weights(dtype)` yields Hugging Face-named tensors."""
        core = object.__new__(cls)
        core._load(config, model_config, tokenizer, Path(name), lambda dtype, quant: weights(dtype))
        return core

    def _load(self, config: EngineConfig, mc: ModelConfig, tokenizer: Any, path: Path,
              weights: Callable[[torch.dtype, QuantConfig], Iterable[tuple[str, Any]]]) -> None:
        self.config = config
        self.device = resolve_device(config.device)
        quant = quantization_for_device(config.quantization, self.device)
        self.dtype = resolve_model_dtype(config.dtype, quant, self.device.type)
        torch.set_num_threads(config.num_threads or os.cpu_count() or 1)
        self.model_config = mc
        self.model_path = path
        self.tokenizer = tokenizer
        self.max_model_len = min(config.max_model_len or mc.max_position_embeddings, mc.max_position_embeddings)
        if self.device.type == "cuda":
            check_weights_fit(mc, self.dtype, self.device, config.cache.gpu_memory_utilization)
        model = build_model(mc, weights(self.dtype, quant), str(path), self.max_model_len, self.dtype, self.device,
                            quant=quant)
        self.weight_bytes = weight_bytes(model)
        self._start(model, config)
        log.info("model %s: %s, %d layers, max_model_len %d, %s on %s, quantization %s, weights %.1f MiB", path,
                 mc.architecture, mc.num_layers, self.max_model_len, str(self.dtype).removeprefix("torch."),
                 self.device, quant.method, self.weight_bytes / 2**20)

    def _start(self, model: torch.nn.Module, config: EngineConfig) -> None:
        """Everything per-run around a loaded model: KV pool, scheduler, runner."""
        self.config = config
        cache = config.cache
        self.runner = self._runner(model, config)
        # Both tiers with a quantized KV cache: hot block ids first, then cold ones.
        self.num_blocks = self.runner.num_blocks + self.runner.num_cold_blocks
        self.kv = KVCacheManager(self.runner.num_blocks, cache.block_size, cache.enable_prefix_caching,
                                 self.runner.num_cold_blocks, cache.kv_hot_tokens)
        self.scheduler = Scheduler(config.scheduler, self.kv)
        # A sequence can never outgrow the pool, so a request running alone always fits.
        self.max_seq_len = min(self.max_model_len, self.num_blocks * cache.block_size)
        self.eos_token_ids = self._eos_ids()
        self._arrivals = ArrivalCounter()
        self._groups: dict[str, _Group] = {}
        self._child_to_group: dict[str, _Group] = {}

    def _runner(self, model: torch.nn.Module, config: EngineConfig) -> ModelRunner:
        """The model runner with its KV pool: sized as configured, or on CUDA by profiling a warm-up
        (worker/gpu_memory.py); then, on CUDA, the decode graphs are captured."""
        cache, sched, mc = config.cache, config.scheduler, self.model_config
        check_kv_cache_dtype(cache.kv_cache_dtype, self.dtype, self.device, config.attention)
        profiled = self.device.type == "cuda" and cache.num_blocks is None and cache.kv_cache_memory_bytes is None
        warm_tokens = min(sched.max_num_batched_tokens, self.max_model_len)
        if profiled:
            blocks, cold = -(-warm_tokens // cache.block_size), 0
        else:
            blocks, cold = kv_tier_blocks(mc, cache, sched, self.dtype, self.max_model_len)
        runner = ModelRunner(model, mc, cache.block_size, blocks, self.dtype, self.device,
                             seed=config.seed, attention=config.attention, num_cold_blocks=cold,
                             kv_cache_dtype=cache.kv_cache_dtype, kv_hot_tokens=cache.kv_hot_tokens)
        if profiled:
            profile = profile_step_memory(runner, warm_tokens, sched.max_num_seqs, cache.gpu_memory_utilization)
            runner.allocate_kv_cache(kv_blocks_from_profile(
                profile, kv_bytes_per_block(mc, cache.block_size, self.dtype), cache.block_size, self.max_model_len))
        if self.device.type == "cuda" and config.cuda_graphs:
            runner.capture_cuda_graphs(sched.max_num_seqs, self.max_model_len)
        return runner

    def with_settings(self, cache: CacheConfig | None = None, scheduler: SchedulerConfig | None = None) -> EngineCore:
        """A new engine over the same loaded model and tokenizer, with its own KV pool and scheduler."""
        clone = object.__new__(EngineCore)
        clone.dtype, clone.model_config, clone.model_path = self.dtype, self.model_config, self.model_path
        clone.device = self.device
        clone.weight_bytes = self.weight_bytes
        clone.tokenizer, clone.max_model_len = self.tokenizer, self.max_model_len
        config = dataclasses.replace(self.config, cache=cache or self.config.cache,
                                     scheduler=scheduler or self.config.scheduler)
        clone._start(self.runner.model, config)
        return clone

    def _eos_ids(self) -> tuple[int, ...]:
        ids = set(self.model_config.eos_token_ids)
        if getattr(self.tokenizer, "eos_token_id", None) is not None:
            ids.add(self.tokenizer.eos_token_id)
        return tuple(sorted(ids))

    # --- requests --------------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    priority: Priority = Priority.NORMAL, prompt: str | None = None) -> None:
        if request_id in self._groups:
            raise RequestError(f"request id {request_id!r} is already in use")
        self._validate(prompt_token_ids, params)
        children: list[Request] = []
        for i in range(params.n):
            child_params = params
            if params.n > 1 and params.seed is not None:
                # Wraps within the generator's 64-bit range, so any valid seed works with any n.
                child_params = _with_seed(params, (params.seed + i) % 2**64)
            children.append(Request(
                request_id=f"{request_id}#{i}" if params.n > 1 else request_id,
                prompt_token_ids=list(prompt_token_ids),
                params=child_params,
                eos_token_ids=self.eos_token_ids,
                priority=Priority(priority),
                arrival=self._arrivals.next(),
                prompt_sibling=children[0] if children else None,
                max_total_tokens=self.max_seq_len,
            ))
        detoks = [IncrementalDetokenizer(self.tokenizer, prompt_token_ids, params.stop_strings,
                                         params.include_stop_str_in_output, params.skip_special_tokens)
                  for _ in children]
        group = _Group(request_id, list(prompt_token_ids), children, detoks, prompt)
        self._groups[request_id] = group
        for child in children:
            self._child_to_group[child.request_id] = group
            self.scheduler.add(child)

    def _validate(self, ids: list[int], params: SamplingParams) -> None:
        """Everything a request brings is checked here, before it can reach a step: a step that a
        request's values break would fail every request in it."""
        if not ids:
            raise RequestError("prompt is empty: at least one token is needed", "prompt")
        vocab = self.model_config.vocab_size
        bad = [t for t in ids if not isinstance(t, int) or not 0 <= t < vocab]
        if bad:
            raise RequestError(f"prompt token ids out of range [0, {vocab}): {bad[:5]}", "prompt")
        if len(ids) >= self.max_seq_len:
            raise RequestError(f"prompt has {len(ids)} tokens, but this engine's context holds at most "
                               f"{self.max_seq_len} tokens (prompt plus at least one generated token)", "prompt")
        if params.top_k > vocab:
            raise RequestError(f"top_k must be -1 (off) or at most the vocabulary size ({vocab}), "
                               f"got {params.top_k}", "top_k")
        for field_name, tids in (("logit_bias", list((params.logit_bias or {}).keys())),
                                 ("stop_token_ids", list(params.stop_token_ids or []))):
            for tid in tids:
                if not 0 <= tid < vocab:
                    raise RequestError(f"token id {tid} is outside the vocabulary [0, {vocab})", field_name)

    def abort(self, request_id: str) -> None:
        group = self._groups.pop(request_id, None)
        if group is None:
            return
        for child in group.children:
            self._child_to_group.pop(child.request_id, None)
            if not child.is_finished:
                self.scheduler.finish(child, FinishReason.ABORT)

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.has_work

    # --- the step --------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        so = self.scheduler.schedule()
        if so.is_empty:
            return []
        ro = self.runner.execute(so, self.scheduler.requests)
        touched = self.scheduler.update(so, ro)
        if self.kv.pool.num_cold:
            self._migrate(so)
        changed: dict[str, _Group] = {}
        for req in touched:
            group = self._child_to_group[req.request_id]
            idx = group.children.index(req)
            stop = group.detoks[idx].add(req.output_token_ids[-1])
            if stop is not None and not req.is_finished:
                self.scheduler.finish(req, FinishReason.STOP, stop)
            elif stop is not None and req.finish_reason is FinishReason.LENGTH:
                req.finish_reason, req.stop_reason = FinishReason.STOP, stop
            changed[group.request_id] = group
        return [self._output(g) for g in changed.values()]

    def _migrate(self, so: SchedulerOutput) -> None:
        """Quantized KV cache: blocks of this step's sequences that left every later query's hot
        window move to the cold tier (the pool swaps ids, the runner quantize-copies the K/V). What a
        query reads depends on its position only, never on when a block moved (kv_quant.py)."""
        reqs = [self.scheduler.requests[s.request_id] for s in so.seqs if s.request_id in self.scheduler.requests]
        self.runner.migrate_blocks(self.kv.migrate_cold(reqs))

    def _output(self, group: _Group) -> RequestOutput:
        outs = []
        for i, (req, detok) in enumerate(zip(group.children, group.detoks)):
            outs.append(CompletionOutput(
                index=i,
                text=detok.visible_text(req.is_finished),
                token_ids=list(req.output_token_ids),
                finish_reason=req.finish_reason,
                stop_reason=req.stop_reason,
                logprobs=list(req.logprobs) if req.params.logprobs is not None else None,
            ))
        finished = all(r.is_finished for r in group.children)
        if finished:
            self._groups.pop(group.request_id, None)
            for child in group.children:
                self._child_to_group.pop(child.request_id, None)
        first = group.children[0]
        queue_time = None
        if first.first_scheduled_time is not None:
            queue_time = first.first_scheduled_time - first.arrival_time
        prompt_lps = None
        if first.params.prompt_logprobs is not None:
            prompt_lps = [None, *first.prompt_logprobs]
        return RequestOutput(group.request_id, group.prompt_token_ids, outs, finished,
                             num_cached_tokens=first.num_cached_tokens, prompt=group.prompt,
                             prompt_logprobs=prompt_lps, queue_time=queue_time)

    # --- introspection ---------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return self.kv.num_free_blocks

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)


def _with_seed(params: SamplingParams, seed: int) -> SamplingParams:
    return dataclasses.replace(params, seed=seed, n=1)
