"""The worker: everything about the device and the model, behind one call per step.

It chooses device, dtype and the weights' form; loads the model; sizes the KV cache (both tiers, or
on CUDA by profiling a warm-up); picks the attention backend; captures CUDA graphs. Each step it
takes a SchedulerOutput (plain data) and returns the sampled tokens. It keeps what sampling needs of
each sequence (seeded generator, output tokens for penalties) from the sequence's first step to its
end, so it never reads the scheduler's objects.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ruvllm.attention.kv_quant import KV_BITS, check_kv_cache_dtype
from ruvllm.config import CacheConfig, EngineConfig, ModelConfig, QuantConfig, SchedulerConfig, SpeculativeConfig
from ruvllm.device import default_num_threads, resolve_device
from ruvllm.errors import AdapterError, RequestError, RuvllmError
from ruvllm.kv_groups import kv_layout
from ruvllm.layers.sampler import SamplingState
from ruvllm.lora.checked_files import CheckedFiles
from ruvllm.lora.manager import LoraManager, Served
from ruvllm.loader import iter_weights, load_model_config, resolve_model
from ruvllm.messages import EngineInfo
from ruvllm.models.registry import build_model, weight_bytes
from ruvllm.models.weight_plan import WeightPlan, float_weight_plan, weight_plan
from ruvllm.parallel.sharding import FileWeights, Weights
from ruvllm.structured.bitmask import new_matcher
from ruvllm.outputs import ModelRunnerOutput, SchedulerOutput
from ruvllm.speculative.draft import DraftProposer
from ruvllm.speculative.proposer import NgramProposer, Proposer
from ruvllm.speculative.policy import SpeculationPolicy, step_seconds
from ruvllm.speculative.verify import Proposal
from ruvllm.worker.gpu_memory import check_weights_fit, kv_blocks_from_profile, profile_step_memory
from ruvllm.worker import kv_disk
from ruvllm.worker.kv_sizing import cold_kv_bytes_per_block, kv_bytes_per_block, kv_tier_blocks
from ruvllm.worker.model_runner import ModelRunner
from ruvllm.worker.pooling import Pooler

if TYPE_CHECKING:
    from ruvllm.loader import ModelSource
    from ruvllm.parallel.ranks import TensorParallelRanks

log = logging.getLogger(__name__)


def _check_hybrid(config: EngineConfig, architecture: str) -> None:
    """What a model with sliding-window layers (several KV groups) cannot run with yet, refused by name."""
    refused = []
    if config.cache.quantized_kv:
        refused.append(f"an {config.cache.kv_cache_dtype} KV cache (use kv_cache_dtype auto)")
    if config.lora.enable_lora:
        refused.append("LoRA adapters")
    if refused:
        raise ValueError(f"{architecture} has sliding-window layers, which ruvllm cannot run with "
                         f"{' or '.join(refused)} yet")

@dataclass
class LoadedModel:
    """A model loaded on its device, and what it was loaded from: what workers over it share."""

    model: torch.nn.Module
    model_config: ModelConfig
    path: Path
    source: ModelSource | None  # None: weights that came from code (no tokenizer)
    device: torch.device
    dtype: torch.dtype
    quant: QuantConfig
    max_model_len: int
    weight_bytes: int
    tensor_parallel: TensorParallelRanks | None = None  # rank 0's: the other ranks' processes

    def close(self) -> None:
        """Stop what loading started outside this process (tensor-parallel ranks); idempotent."""
        if self.tensor_parallel is not None:
            self.tensor_parallel.close()


def load_model(config: EngineConfig, mc: ModelConfig, path: Path, source: ModelSource | None,
               plan_for: Callable[[QuantConfig, str, torch.device], WeightPlan],
               weights: Callable[[WeightPlan], Iterable[tuple[str, Any]]],
               rank_weights: Callable[[], Weights]) -> LoadedModel:
    """The weights' form from the plan (headers only), then the model built once in that form. With
    tensor parallelism this process holds rank 0's slice and the other ranks load theirs in processes
    of their own (`rank_weights`: the float weights as a function every rank can call)."""
    device = resolve_device(config.device)
    plan = plan_for(config.quantization, config.dtype, device)
    max_model_len = min(config.max_model_len or mc.max_position_embeddings, mc.max_position_embeddings)
    if config.tensor_parallel_size > 1:
        from ruvllm.parallel.ranks import TensorParallelRanks, rank_threads

        torch.set_num_threads(rank_threads(config))
        tp = TensorParallelRanks(config, mc, plan, device, max_model_len, rank_weights(), str(path))
        loaded = LoadedModel(tp.model, mc, path, source, device, plan.dtype, plan.quant, max_model_len,
                             tp.weight_bytes, tp)
        log.info("model %s: %s, %d layers, max_model_len %d, %s on %s, %d tensor-parallel ranks, weights %.1f MiB "
                 "in all", path, mc.architecture, mc.num_layers, max_model_len, str(plan.dtype).removeprefix("torch."),
                 device, tp.size, tp.weight_bytes / 2**20)
        return loaded
    torch.set_num_threads(config.num_threads or default_num_threads())
    if device.type == "cuda":
        check_weights_fit(plan.total_bytes, ", ".join(f"{n} {form}" for form, n in plan.linear_forms().items()),
                          device, config.cache.gpu_memory_utilization)
    model = build_model(mc, weights(plan), str(path), max_model_len, plan.dtype, device, plan=plan)
    loaded = LoadedModel(model, mc, path, source, device, plan.dtype, plan.quant, max_model_len, weight_bytes(model))
    log.info("model %s: %s, %d layers, max_model_len %d, %s on %s, quantization %s, weights %.1f MiB", path,
             mc.architecture, mc.num_layers, max_model_len, str(plan.dtype).removeprefix("torch."), device,
             plan.quant.method, loaded.weight_bytes / 2**20)
    return loaded


class Worker:
    def __init__(self, loaded: LoadedModel, config: EngineConfig) -> None:
        """A worker over a loaded model, with the KV pool, adapters and speculation `config` asks for
        (several workers may share one model: with_settings). Loading is `load` / `from_weights`."""
        self.loaded = loaded
        self.model_config = mc = loaded.model_config
        self.tensor_parallel = loaded.tensor_parallel
        self.device, self.dtype = loaded.device, loaded.dtype
        if kv_layout(mc).is_hybrid:
            _check_hybrid(config, mc.architecture)
        self.config = config = dataclasses.replace(config, scheduler=config.scheduler.resolved(self.device.type))
        self.runner = self._runner(loaded.model, config)
        self._states: dict[str, SamplingState] = {}  # each sequence's state, from its first step to its end
        self.pooler = Pooler()  # each embedding request's pooling across its chunks
        self.lora: LoraManager | None = None
        if config.lora.enable_lora:
            self.lora = LoraManager(mc, config.lora, self.dtype, self.device)
            self.runner.lora = self.lora
            log.info("LoRA: %d adapter slots of rank %d, %.1f MiB", config.lora.max_loras,
                     config.lora.max_lora_rank, self.lora.slots.nbytes / 2**20)
        spec = config.speculation
        self.proposer: Proposer | None = None
        if spec.method == "draft":
            self.proposer = self._load_draft(config)
        elif spec.method == "ngram":
            self.proposer = NgramProposer(spec.ngram_min, spec.ngram_max)
        # None with speculation on: every sequence takes all the room it is given (K)
        self.spec_policy = self._speculation_policy(config) if spec.method and spec.adaptive_speculation else None
        self.kv_disk = self._open_kv_disk(config)  # the disk tier's store (None: no tier)

    def _open_kv_disk(self, config: EngineConfig) -> kv_disk.KVDiskStore | None:
        """The disk KV tier of --kv-disk-path; a combination it cannot serve is refused by name."""
        if config.cache.kv_disk_path is None:
            return None
        refused = kv_disk.refusal(config, self.loaded, self.runner.layout.is_hybrid)
        if refused is not None:
            raise ValueError(refused)
        return kv_disk.KVDiskStore.open(self.loaded, config, self.runner)

    @classmethod
    def load(cls, config: EngineConfig) -> Worker:
        """A worker over the model `config` names (a path, a name, or the embedded default)."""
        src = resolve_model(config.model)
        return cls._over(load_model(
            config, load_model_config(src), src.path, src,
            lambda quant, dtype, device: weight_plan(src, quant, dtype, device),
            lambda plan: iter_weights(src, plan.dtype, keep_quantized=plan.keep_packed),
            lambda: FileWeights(src)), config)

    @classmethod
    def from_weights(cls, model_config: ModelConfig, weights: Callable[[torch.dtype], Iterable[tuple[str, Any]]],
                     config: EngineConfig, name: str = "in-memory") -> Worker:
        """A worker over weights that come from code rather than a file (tests and benchmarks on
        random models): `weights(dtype)` yields Hugging Face-named float tensors. (With tensor
        parallelism every rank's process calls it, so it must pickle.)"""
        return cls._over(load_model(
            config, model_config, Path(name), None,
            lambda quant, dtype, device: float_weight_plan(model_config, quant, dtype, device, name),
            lambda plan: weights(plan.dtype), lambda: weights), config)

    @classmethod
    def _over(cls, loaded: LoadedModel, config: EngineConfig) -> Worker:
        try:
            return cls(loaded, config)
        except BaseException:
            loaded.close()
            raise

    def close(self) -> None:
        """Stop what this worker's model started outside its process (tensor-parallel ranks); idempotent.
        The disk tier's writer finishes what is queued first."""
        store, self.kv_disk = getattr(self, "kv_disk", None), None
        if store is not None:
            store.close()
        self.loaded.close()

    # --- speculative decoding --------------------------------------------------------------------
    def _load_draft(self, config: EngineConfig) -> DraftProposer:
        """The draft model, on a KV pool of its own with the target's block count (docs/speculative.md)."""
        spec = config.speculation
        if config.cache.quantized_kv:
            raise ValueError(f"a draft model cannot run beside an {config.cache.kv_cache_dtype} KV cache (its pool "
                             "has no cold tier); use --speculative ngram, or kv_cache_dtype auto")
        src = resolve_model(spec.speculative_model)
        mc = load_model_config(src)
        if kv_layout(mc).is_hybrid:
            raise ValueError(f"the draft model is a {mc.architecture} model with sliding-window layers; a draft "
                             "runs on the target's block tables of full-attention layers, so it must have none")
        if mc.vocab_size != self.model_config.vocab_size:
            raise ValueError(f"the draft model's vocabulary ({mc.vocab_size} tokens) is not the target's "
                             f"({self.model_config.vocab_size}): a draft must share the target's tokenizer")
        if self.loaded.source is not None:
            from ruvllm.loader import load_tokenizer

            if load_tokenizer(src).get_vocab() != load_tokenizer(self.loaded.source).get_vocab():
                raise ValueError("the draft model's tokenizer is not the target's: a draft must share it")
        plan = weight_plan(src, QuantConfig(method=spec.speculative_quantization), config.dtype, self.device)
        model = build_model(mc, iter_weights(src, plan.dtype, keep_quantized=plan.keep_packed), str(src.path),
                            self.loaded.max_model_len, plan.dtype, self.device, plan=plan)
        runner = ModelRunner(model, mc, config.cache.block_size, self.runner.num_blocks, plan.dtype, self.device,
                             attention=config.attention)
        log.info("draft model %s: %d layers, %s, quantization %s, %d proposals a step", src.path, mc.num_layers,
                 str(plan.dtype).removeprefix("torch."), plan.quant.method, spec.num_speculative_tokens)
        return DraftProposer(runner, config.scheduler.token_budget, config.seed)

    def _speculation_policy(self, config: EngineConfig) -> SpeculationPolicy:
        """The policy's costs, measured on this device: a target pass over 1 + K rows against one
        row, and a draft pass against a target pass (speculative/policy.py)."""
        k = config.speculation.num_speculative_tokens
        one = step_seconds(self.runner, 1)
        more = step_seconds(self.runner, 1 + k)
        row_cost = max(0.0, (more - one) / (k * one))
        draft = self.proposer if isinstance(self.proposer, DraftProposer) else None
        draft_cost = step_seconds(draft.runner, 1) / one if draft is not None else 0.0
        log.info("speculation: one more row costs %.3f of a decode step, a draft pass %.3f", row_cost, draft_cost)
        return SpeculationPolicy(row_cost, draft_cost)

    def _propose(self, so: SchedulerOutput) -> tuple[SchedulerOutput, dict[str, Proposal]]:
        """Proposals for the sequences the scheduler left room for, and the step with their tokens
        appended to those sequences' chunks."""
        room = [(seq, self._states[seq.request_id]) for seq in so.seqs if seq.num_lookahead]
        if not room or self.proposer is None:
            return so, {}
        policy = self.spec_policy
        proposals = self.proposer.propose(room, (lambda rid, offered: offered) if policy is None else policy.length)
        proposals = {rid: p for rid, p in proposals.items() if p.tokens}
        if not proposals:
            return so, {}
        seqs = [dataclasses.replace(seq, token_ids=seq.token_ids + proposals[seq.request_id].tokens)
                if seq.request_id in proposals else seq for seq in so.seqs]
        return SchedulerOutput(seqs=seqs), proposals

    # --- adapters --------------------------------------------------------------------------------
    def _lora(self) -> LoraManager:
        if self.lora is None:
            raise AdapterError("LoRA adapters are not enabled for this engine (enable_lora / --enable-lora)")
        return self.lora

    def read_adapter(self, name: str, path: str, checked: CheckedFiles | None = None) -> Served:
        lora = self._lora()
        try:
            return lora.read(name, path, checked)
        except RuvllmError:
            raise
        except Exception as e:  # a file we did not foresee: the adapter is bad, the engine is fine
            raise AdapterError(f"adapter {path[:200]}: cannot be read ({type(e).__name__}: {e})") from None

    def install_adapter(self, adapter: Served) -> None:
        self._lora().install(adapter)

    def load_tokenizer(self) -> Any:
        """The model's tokenizer: structured outputs compile against its vocabulary."""
        from ruvllm.loader import load_tokenizer

        if self.loaded.source is None:
            raise RequestError("structured outputs need the model's tokenizer; this model was built in memory")
        return load_tokenizer(self.loaded.source)

    def remove_adapter(self, name: str) -> None:
        if self.lora is not None:
            self.lora.remove(name)

    def _runner(self, model: torch.nn.Module, config: EngineConfig) -> ModelRunner:
        """The model runner with its KV pool: sized as configured, or on CUDA by profiling a warm-up
        (worker/gpu_memory.py); then, on CUDA, the decode graphs are captured."""
        cache, sched, mc = config.cache, config.scheduler, self.model_config
        check_kv_cache_dtype(cache.kv_cache_dtype, self.dtype, self.device, config.attention)
        # (a two-tier cache is sized by its settings: the profile sizes one tier)
        profiled = (self.device.type == "cuda" and cache.num_blocks is None and cache.kv_cache_memory_bytes is None
                    and not cache.quantized_kv)
        warm_tokens = min(sched.max_num_batched_tokens, self.loaded.max_model_len)
        make: Callable[..., ModelRunner] = ModelRunner
        tp = self.tensor_parallel
        if tp is not None:  # rank 0's slice: its heads' share of the pool, its runner announcing each call
            mc, cache, make = tp.local_config, tp.rank_cache(cache), tp.runner_class()
        if profiled:
            blocks, cold = -(-warm_tokens // cache.block_size), 0
        else:
            blocks, cold = kv_tier_blocks(mc, cache, sched, self.dtype, self.loaded.max_model_len)
        runner = make(model, mc, cache.block_size, blocks, self.dtype, self.device,
                      seed=config.seed, attention=config.attention, num_cold_blocks=cold,
                      kv_cache_dtype=cache.kv_cache_dtype, kv_hot_tokens=cache.kv_hot_tokens)
        if profiled:
            profile = profile_step_memory(runner, warm_tokens, sched.max_num_seqs, cache.gpu_memory_utilization)
            runner.allocate_kv_cache(kv_blocks_from_profile(
                profile, kv_bytes_per_block(mc, cache.block_size, self.dtype), cache.block_size, self.loaded.max_model_len))
        if (self.device.type == "cuda" and config.cuda_graphs and not runner.layout.is_hybrid and tp is None
                and not cache.quantized_kv):
            # (decode graphs hold one block table per sequence: models with KV groups run eagerly;
            # tensor-parallel steps too: rank 0 announces each call, which a replayed graph would skip;
            # and a two-tier cache: the graphs' attention metadata has no cold tier)
            runner.capture_cuda_graphs(sched.max_num_seqs, self.loaded.max_model_len, config.async_scheduling)
        return runner

    def with_settings(self, cache: CacheConfig | None = None, scheduler: SchedulerConfig | None = None,
                      speculation: SpeculativeConfig | None = None) -> Worker:
        """A new worker over the same loaded model, with its own KV pool (sized by the new settings)
        and its own speculation (a draft model is loaded anew)."""
        if self.tensor_parallel is not None:
            raise ValueError("with_settings cannot share a tensor-parallel model (its ranks hold one KV pool "
                             "each); load another engine instead")
        return Worker(self.loaded, dataclasses.replace(self.config, cache=cache or self.config.cache,
                                                       scheduler=scheduler or self.config.scheduler,
                                                       speculation=speculation or self.config.speculation))

    def info(self) -> EngineInfo:
        runner, cache, sched = self.runner, self.config.cache, self.config.scheduler
        num_blocks = runner.num_blocks + runner.num_cold_blocks
        # Under tensor parallelism every rank holds an equal slice of each block: the pool's bytes
        # are rank 0's times the ranks (more than one model's when KV heads are replicated).
        ranks, kv_config = 1, self.model_config
        if self.tensor_parallel is not None:
            ranks, kv_config = self.tensor_parallel.size, self.tensor_parallel.local_config
        return EngineInfo(
            model=str(self.loaded.path), architecture=self.model_config.architecture,
            vocab_size=self.model_config.vocab_size, max_model_len=self.loaded.max_model_len,
            # A sequence can never outgrow the pool, so a request running alone always fits.
            max_seq_len=runner.layout.max_tokens(num_blocks, sched.max_num_batched_tokens, cache.block_size,
                                                 self.loaded.max_model_len),
            eos_token_ids=tuple(self.model_config.eos_token_ids), block_size=cache.block_size,
            num_hot_blocks=runner.num_blocks, num_cold_blocks=runner.num_cold_blocks,
            hot_block_bytes=ranks * kv_bytes_per_block(kv_config, cache.block_size, self.dtype),
            cold_block_bytes=(cold_kv_bytes_per_block(self.model_config, cache.block_size, KV_BITS[cache.kv_cache_dtype])
                              if cache.quantized_kv else 0),
            kv_cache_bytes=ranks * runner.kv_cache_bytes, kv_cache_dtype=cache.kv_cache_dtype,
            weight_bytes=self.loaded.weight_bytes, device=str(self.device), dtype=str(self.dtype).removeprefix("torch."),
            quantization=self.loaded.quant.method, max_num_seqs=sched.max_num_seqs,
            max_num_batched_tokens=sched.max_num_batched_tokens,
            max_loras=self.config.lora.max_loras if self.config.lora.enable_lora else 0,
            kv_windows=runner.layout.windows, pooling=self.config.pooling,
            hidden_size=self.model_config.hidden_size)

    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        """One step: forget ended sequences, set up new ones, move cold blocks, run, sample."""
        for rid in so.finished_ids:
            self._states.pop(rid, None)
            self.pooler.forget(rid)
            if self.proposer is not None:
                self.proposer.forget(rid)
            if self.spec_policy is not None:
                self.spec_policy.forget(rid)
        for rid in so.preempted:
            self.pooler.preempted(rid)
            if self.proposer is not None:
                self.proposer.preempted(rid)
        for req in so.new_requests:
            if req.pooling is not None:  # an embedding: pooled, never sampled
                self.pooler.start(req.request_id, req.pooling)
                continue
            grammar = so.grammars.get(req.request_id)
            self._states[req.request_id] = SamplingState(req.request_id, req.params, req.prompt_token_ids,
                                                         tuple(req.eos_token_ids),
                                                         matcher=None if grammar is None else new_matcher(
                                                             grammar, req.params.structured.after_tokens))
        if so.kv_spills and self.kv_disk is not None:
            # Copied out before this step writes the pool: a spilled block may be one a load or the
            # forward pass fills now. The files are written on the store's thread.
            ids = [b for b, _ in so.kv_spills]
            self.kv_disk.spill(kv_disk.read_blocks(self.runner, ids), [d for _, d in so.kv_spills],
                               wait=so.is_empty)
        for load in so.kv_loads:
            kv_disk.write_blocks(self.runner, load)
        if so.kv_moves:
            self.runner.migrate_blocks(so.kv_moves)
        if so.is_empty:
            return ModelRunnerOutput({}, {}, {})
        run, proposals = self._propose(so)
        out = self.runner.execute(run, self._states, proposals, self.pooler)
        for seq in so.seqs:
            prop = proposals.get(seq.request_id)
            if prop is not None:
                accepted = len(out.sampled[seq.request_id]) - 1
                if self.spec_policy is not None:
                    self.spec_policy.observe(seq.request_id, len(prop.tokens), accepted)
                self.proposer.accepted(seq.request_id, seq.start_position, accepted)  # type: ignore[union-attr]
        return out

    @property
    def model(self) -> torch.nn.Module:
        return self.runner.model

