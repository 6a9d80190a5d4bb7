"""The offline API: `LLM(model).generate(prompts, SamplingParams(...))` and `LLM.chat(messages)`."""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any

from rich.progress import Progress

from ruvllm.config import CacheConfig, EngineConfig, QuantConfig, SchedulerConfig
from ruvllm.core.engine_core import EngineCore
from ruvllm.engine.prompts import encode_prompt, normalize_prompts, render_chat
from ruvllm.outputs import RequestOutput
from ruvllm.request import Priority
from ruvllm.sampling_params import SamplingParams


def build_engine_config(model: str | None = None, **kwargs: Any) -> EngineConfig:
    """Flat keyword settings (as vLLM's LLM takes them) sorted into the per-concern configs.

    `quantization` is a method name ("int4", ...) or a whole QuantConfig; `group_size` and
    `keep_16bit` go to the QuantConfig."""
    quant = kwargs.pop("quantization", None)
    parts: dict[type, dict[str, Any]] = {EngineConfig: {}, CacheConfig: {}, SchedulerConfig: {}, QuantConfig: {}}
    if isinstance(quant, QuantConfig):
        parts[QuantConfig] = dataclasses.asdict(quant)
    elif quant is not None:
        parts[QuantConfig]["method"] = quant
    for key, value in kwargs.items():
        for cls in parts:
            if key in {f.name for f in dataclasses.fields(cls)} and key not in ("cache", "scheduler", "method"):
                parts[cls][key] = value
                break
        else:
            raise TypeError(f"unknown engine setting {key!r}")
    return EngineConfig(model=model, cache=CacheConfig(**parts[CacheConfig]),
                        scheduler=SchedulerConfig(**parts[SchedulerConfig]),
                        quantization=QuantConfig(**parts[QuantConfig]), **parts[EngineConfig])


class LLM:
    def __init__(self, model: str | None = None, **kwargs: Any) -> None:
        self._attach(EngineCore(build_engine_config(model, **kwargs)))

    @classmethod
    def from_engine(cls, engine: EngineCore) -> LLM:
        llm = object.__new__(cls)
        llm._attach(engine)
        return llm

    def _attach(self, engine: EngineCore) -> None:
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self._ids = itertools.count()

    def generate(self, prompts: Any, sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 priority: Priority | list[Priority] = Priority.NORMAL,
                 show_progress: bool = False) -> list[RequestOutput]:
        items = normalize_prompts(prompts)
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params or SamplingParams()] * len(items)
        prios = priority if isinstance(priority, list) else [priority] * len(items)
        if len(params) != len(items) or len(prios) != len(items):
            raise ValueError("sampling_params and priority lists must be as long as the prompts list")
        encoded = [encode_prompt(self.tokenizer, p) for p in items]
        return self._run([(ids, text) for ids, text in encoded], params, prios, show_progress)

    def chat(self, messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
             sampling_params: SamplingParams | None = None, chat_template: str | None = None,
             add_generation_prompt: bool = True) -> list[RequestOutput]:
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        encoded = [(render_chat(self.tokenizer, conv, chat_template, add_generation_prompt), None)
                   for conv in conversations]  # type: ignore[arg-type]
        params = sampling_params or SamplingParams()
        return self._run(encoded, [params] * len(encoded), [Priority.NORMAL] * len(encoded), False)

    def _run(self, encoded: list[tuple[list[int], str | None]], params: list[SamplingParams],
             prios: list[Priority], show_progress: bool) -> list[RequestOutput]:
        ids = []
        try:
            for (tokens, text), p, prio in zip(encoded, params, prios):
                rid = str(next(self._ids))
                self.engine.add_request(rid, tokens, p, prio, prompt=text)
                ids.append(rid)
        except Exception:
            for rid in ids:
                self.engine.abort(rid)
            raise
        results: dict[str, RequestOutput] = {}
        with Progress(disable=not show_progress, transient=True) as progress:
            task = progress.add_task("generating", total=len(ids))
            while self.engine.has_unfinished:
                for out in self.engine.step():
                    if out.finished:
                        results[out.request_id] = out
                        progress.advance(task)
        return [results[rid] for rid in ids]
