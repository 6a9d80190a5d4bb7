"""The offline API: `LLM(model).generate(prompts, SamplingParams(...))` and `LLM.chat(messages)`."""

from __future__ import annotations

import dataclasses
import itertools
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.progress import Progress

from ruvllm.config import (CacheConfig, EngineConfig, LoraConfig, QuantConfig, SchedulerConfig, SpeculativeConfig,
                           declared)
from ruvllm.core.engine_core import EngineCore
from ruvllm.engine.async_engine import AsyncEngine
from ruvllm.engine.generation import GenerationService
from ruvllm.engine.core_client import InlineCoreClient
from ruvllm.engine.input_processor import core_requests, embed_request, stop_token_set
from ruvllm.engine.output_processor import OutputProcessor
from ruvllm.engine.prompts import encode_prompt, normalize_prompts, render_chat
from ruvllm.messages import (CoreOutput, EngineInfo, EngineStats, GetStats, LoadAdapter, ResetPrefixCache,
                             UnloadAdapter)
from ruvllm.errors import RequestError
from ruvllm.outputs import EmbeddingOutput, OutputKind, RequestOutput
from ruvllm.request import Priority
from ruvllm.sampling_params import SamplingParams
from ruvllm.tenants import DEFAULT_TENANT

if TYPE_CHECKING:
    from ruvllm.learning.config import LearningConfig
    from ruvllm.learning.learner import FeedbackResult, Learner


def build_engine_config(model: str | None = None, **kwargs: Any) -> EngineConfig:
    """Flat keyword settings (as vLLM's LLM takes them) sorted into the per-concern configs, each of
    which checks its own (the `setting` fields of config.py).

    `quantization` is a method name ("int4", ...) or a whole QuantConfig; `group_size` and
    `keep_16bit` go to the QuantConfig."""
    quant = kwargs.pop("quantization", None)
    sections = {"cache": CacheConfig, "scheduler": SchedulerConfig, "quantization": QuantConfig, "lora": LoraConfig,
                "speculation": SpeculativeConfig}
    parts: dict[type, dict[str, Any]] = {cls: {} for cls in (EngineConfig, *sections.values())}
    if isinstance(quant, QuantConfig):
        parts[QuantConfig] = dataclasses.asdict(quant)
    elif quant is not None:
        parts[QuantConfig]["method"] = quant
    owner = {d.name: d.owner for cls in parts for d in declared(cls) if d.name != "method"}
    for key, value in kwargs.items():
        if key not in owner:
            raise TypeError(f"unknown engine setting {key!r}")
        parts[owner[key]][key] = value
    return EngineConfig(model=model, **{name: cls(**parts[cls]) for name, cls in sections.items()},
                        **parts[EngineConfig])


class LLM:
    """Offline generation: the core runs in this process, stepped by the caller's thread."""

    def __init__(self, model: str | EngineConfig | EngineCore | None = None, tokenizer: Any = None,
                 **kwargs: Any) -> None:
        """`LLM(model, **settings)` loads a model as vLLM's LLM does (a path or name; None: the
        embedded default; keyword settings as `build_engine_config` takes them). The built parts
        are taken too: an EngineConfig, or an EngineCore with its tokenizer."""
        if not isinstance(model, EngineCore):
            config = model if isinstance(model, EngineConfig) else build_engine_config(model, **kwargs)
            model, tokenizer = self._load(config)
        self.core = model
        self.tokenizer = tokenizer
        self.info: EngineInfo = model.info
        self._eos = stop_token_set(self.info, tokenizer)
        self._ids = itertools.count()
        self.learner: Learner | None = None
        # The caller's thread drives the core through the same loop and messages as the other
        # clients; what each turn emits waits here for the call that drives it.
        self._outputs: list[CoreOutput] = []
        self._client = InlineCoreClient(model)
        self._client.start(self._outputs.extend, _raise)

    @classmethod
    def from_config(cls, config: EngineConfig) -> LLM:
        return cls(config)

    @classmethod
    def from_core(cls, core: EngineCore, tokenizer: Any) -> LLM:
        return cls(core, tokenizer)

    @staticmethod
    def _load(config: EngineConfig) -> tuple[EngineCore, Any]:
        from ruvllm.loader import load_tokenizer, resolve_model
        from ruvllm.worker.worker import Worker

        tokenizer = load_tokenizer(resolve_model(config.model))
        return EngineCore(Worker.load(config), config), tokenizer

    def with_settings(self, cache: CacheConfig | None = None, scheduler: SchedulerConfig | None = None,
                      speculation: SpeculativeConfig | None = None) -> LLM:
        """Another LLM over the same loaded model, with its own KV pool and scheduler (tests and
        benchmarks compare settings without loading the model again), sharing this one's grammar
        compiler (core/engine_core.py's SharedGrammars)."""
        worker = self.core.executor.with_settings(cache, scheduler, speculation)  # type: ignore[attr-defined]
        return LLM(EngineCore(worker, worker.config, self.core.grammars), self.tokenizer)

    def async_engine(self) -> AsyncEngine:
        """An AsyncEngine over this LLM's core, on a thread of this process (the LLM must not
        generate while it runs)."""
        return AsyncEngine.in_process(self.core, self.tokenizer)

    def stats(self) -> EngineStats:
        return self._client.call(GetStats()).stats

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """Every id that ends a completion (the model's EOS ids and the tokenizer's)."""
        return self._eos

    @property
    def model(self) -> Any:
        """The loaded torch module, for inspection (which form each layer's weights took)."""
        return self.core.executor.model  # type: ignore[attr-defined]

    def reset_prefix_cache(self) -> None:
        self._client.call(ResetPrefixCache())

    def close(self) -> None:
        """Stop the processes this engine started (tensor-parallel ranks: they also stop when the
        LLM is garbage-collected or the interpreter exits). The LLM cannot generate afterwards."""
        self.core.close()

    # --- LoRA adapters (LLM(..., enable_lora=True)) ---------------------------------------------------
    def load_lora(self, name: str, path: str | Path, files: dict[str, tuple[str, int, int]] | None = None) -> None:
        """Load a PEFT LoRA adapter folder under `name` (AdapterError names what is wrong with it;
        `files`: as AsyncEngine.load_lora's)."""
        self._client.call(LoadAdapter(name, str(path), files))

    def unload_lora(self, name: str) -> None:
        self._client.call(UnloadAdapter(name))

    def loras(self) -> list[str]:
        return self.core.adapters()

    def _adapter(self, lora: str | Path | None) -> str | None:
        """A loaded adapter's name; a folder not loaded yet is loaded under its path."""
        if lora is None or str(lora) in self.core.adapters():
            return None if lora is None else str(lora)
        self.load_lora(str(lora), lora)
        return str(lora)

    def generate(self, prompts: Any, sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 priority: Priority | list[Priority] = Priority.NORMAL,
                 show_progress: bool = False, lora: str | Path | list[str | Path | None] | None = None,
                 tenant: str = DEFAULT_TENANT) -> list[RequestOutput]:
        """`lora`: a loaded adapter's name or an adapter folder, for every prompt or one per prompt.
        `tenant`: whose requests these are (its own prefix cache, and with learning its adapter)."""
        items = normalize_prompts(prompts)
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params or SamplingParams()] * len(items)
        prios = priority if isinstance(priority, list) else [priority] * len(items)
        if len(params) != len(items) or len(prios) != len(items):
            raise ValueError("sampling_params and priority lists must be as long as the prompts list")
        loras = lora if isinstance(lora, list) else [lora] * len(items)
        if len(loras) != len(items):
            raise ValueError("the lora list must be as long as the prompts list")
        adapters = [self._adapter(x) for x in loras]
        encoded = [encode_prompt(self.tokenizer, p) for p in items]
        return self._run([(ids, text) for ids, text in encoded], params, prios, show_progress, adapters, tenant)

    def chat(self, messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
             sampling_params: SamplingParams | None = None, chat_template: str | None = None,
             add_generation_prompt: bool = True, lora: str | Path | None = None,
             tenant: str = DEFAULT_TENANT) -> list[RequestOutput]:
        """`lora`: a loaded adapter's name or an adapter folder, for every conversation."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        encoded = [(render_chat(self.tokenizer, conv, chat_template, add_generation_prompt), None)
                   for conv in conversations]  # type: ignore[arg-type]
        params = sampling_params or SamplingParams()
        adapter = self._adapter(lora)
        return self._run(encoded, [params] * len(encoded), [Priority.NORMAL] * len(encoded), False,
                         [adapter] * len(encoded), tenant)

    def write(self, prompts: list[list[int]], params: SamplingParams) -> list[list[str]]:
        """The learner's host's (learning/learner.py AdapterHost): the base model's texts for `prompts`
        (params.n each), with no tenant's adapter, kept for no feedback and witnessed by none."""
        outs = self._run([(p, None) for p in prompts], [params] * len(prompts), [Priority.NORMAL] * len(prompts),
                         False, plain=True)
        return [[c.text for c in out.outputs] for out in outs]

    def _run(self, encoded: list[tuple[list[int], str | None]], params: list[SamplingParams],
             prios: list[Priority], show_progress: bool, adapters: list[str | None] | None = None,
             tenant: str = DEFAULT_TENANT, plain: bool = False) -> list[RequestOutput]:
        # Every request is checked before any is added: a bad one refuses the whole call.
        # tenant, adapter, salt and recorder: as the server decides them (plain: no learner, no witness)
        service = GenerationService(None if plain else self.learner)
        calls = [service.open(str(next(self._ids)), tenant, adapter, [tokens], [p])
                 for (tokens, _), p, adapter in zip(encoded, params, adapters or [None] * len(encoded))]
        rids = [c.request_id for c in calls]
        seqs = [core_requests(c.request_id, tokens, p, prio, self.info, self._eos, c.adapter, c.cache_salt, c.stacked)
                for c, (tokens, _), p, prio in zip(calls, encoded, params, prios)]
        processor = OutputProcessor(self.tokenizer)
        for rid, (tokens, text), p, group in zip(rids, encoded, params, seqs):
            processor.add(rid, tokens, text, p, [s.request_id for s in group], OutputKind.FINAL_ONLY)
            self._client.add(group)
        results: dict[str, RequestOutput] = {}
        try:
            with Progress(disable=not show_progress, transient=True) as progress:
                task = progress.add_task("generating", total=len(rids))
                while len(results) < len(rids):
                    self._client.poll()
                    outs, aborts = processor.process(self._outputs)
                    self._outputs.clear()
                    if aborts:  # stop strings matched: freed before the next step
                        self._client.abort(aborts)
                    for out in outs:
                        results[out.request_id] = out
                        progress.advance(task)
        finally:
            # Interrupted (Ctrl-C, an error): nothing of this call stays in the engine.
            self._outputs.clear()
            self._client.abort([s.request_id for group in seqs for s in group])
            self._client.poll()
        for call in calls:
            call.record(0, results[call.request_id])
        return [results[rid] for rid in rids]

    def embed(self, inputs: Any, pooling: str | None = None, priority: Priority = Priority.NORMAL,
              lora: str | Path | None = None, tenant: str = DEFAULT_TENANT) -> list[EmbeddingOutput]:
        """Each input's final hidden states (after the final norm) pooled and L2-normalized: one
        vector per input, in order. `inputs`: a string, a list of token ids, or a list of either.
        `pooling`: "last" (the last token's state) or "mean" (every token's average); None: the
        engine's setting (EngineConfig.pooling). The inputs run through the scheduler together, and
        each gets the same vector, bit for bit, as it would alone. `tenant` and `lora` as in generate."""
        items = normalize_prompts(inputs)
        service = GenerationService(self.learner)
        call = service.open(str(next(self._ids)), tenant, self._adapter(lora), [], [])
        encoded = [encode_prompt(self.tokenizer, p)[0] for p in items]
        # Every input is checked before any is added: a bad one refuses the whole call.
        requests = [embed_request(f"{call.request_id}-{i}", ids, priority, self.info, pooling, call.adapter,
                                  call.cache_salt, call.stacked) for i, ids in enumerate(encoded)]
        wanted = {r.request_id: i for i, r in enumerate(requests)}
        results: dict[int, EmbeddingOutput] = {}
        self._client.add(requests)
        try:
            while len(results) < len(requests):
                self._client.poll()
                for out in self._outputs:
                    i = wanted.get(out.request_id)
                    if i is None:
                        continue
                    if out.embedding is None:  # the core ended it (its adapter was unloaded meanwhile)
                        raise RequestError(f"input {i} ended before it was embedded ({out.finish_reason})", "input")
                    results[i] = EmbeddingOutput.from_bytes(out.request_id, encoded[i], out.embedding,
                                                            out.num_cached_tokens, out.queue_time)
                self._outputs.clear()
        finally:
            self._outputs.clear()
            self._client.abort([r.request_id for r in requests])  # (interrupted: nothing stays in the engine)
            self._client.poll()
        return [results[i] for i in range(len(requests))]

    # --- learning from feedback (docs/learning.md) --------------------------------------------------------
    def enable_learning(self, config: LearningConfig | None = None) -> Learner:
        """Keep completions for feedback and learn from it: each tenant's micro-LoRA, served as its
        adapter (needs enable_lora, with a slot rank of at least the micro-LoRA's)."""
        if self.learner is None:
            self.learner = GenerationService.new_learner(self, self.info.model, self.tokenizer, self._eos, config)
        return self.learner

    def feedback(self, request_id: str, score: float, correction: str | None = None,
                 tenant: str = DEFAULT_TENANT) -> FeedbackResult:
        """Learn from feedback on a completion this LLM returned (its RequestOutput.request_id):
        a score from -1 to 1, and optionally the better answer. FeedbackError when refused."""
        if self.learner is None:
            raise RuntimeError("learning is not enabled (LLM.enable_learning())")
        return GenerationService(self.learner).feedback(request_id, tenant, score, correction)


def _raise(error: BaseException) -> None:
    raise error
