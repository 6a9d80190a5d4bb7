"""The generation service: what a generation call decides once, whichever front it comes through (the
server's API dialects, the offline `LLM`): its tenant (and with it the prefix-cache salt), its adapter
(the one named, else the tenant's learned one; with learning, a named adapter carries the tenant's
learned micro-LoRA stacked on it), and who is told what it produced (the learner keeps completions
for feedback, the witness log records them)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import aclosing
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from ruvllm.engine.input_processor import check_embed_request, check_request
from ruvllm.errors import AdapterNotFoundError, RequestError, RuvllmError
from ruvllm.outputs import CompletionOutput, EmbeddingOutput, OutputKind, RequestOutput
from ruvllm.request import Priority
from ruvllm.sampling_params import SamplingParams
from ruvllm.tenants import LEARNED_PREFIX, may_use, tenant_salt

if TYPE_CHECKING:
    from ruvllm.engine.async_engine import AsyncEngine
    from ruvllm.learning.config import LearningConfig
    from ruvllm.learning.learner import AdapterHost, FeedbackEvent, FeedbackResult, Learner
    from ruvllm.witness.log import WitnessLog


@dataclass
class GenerationService:
    learner: Learner | None = None
    witness: WitnessLog | None = None
    model_name: str = ""  # what the witness log records a completion under, and whether with its token ids
    witness_store_tokens: bool = False

    @staticmethod
    def new_learner(host: AdapterHost, model: str | None, tokenizer: Any, eos_token_ids: tuple[int, ...],
                    config: LearningConfig | None) -> Learner:
        """A learner that publishes its adapter versions into `host` (an LLM or an AsyncEngine)."""
        from ruvllm.learning.learner import Learner

        eos = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else eos_token_ids[0]
        return Learner(model, host, tokenizer, eos, config)

    def open(self, request_id: str, tenant: str, adapter: str | None, prompts: list[list[int]],
             params: list[SamplingParams]) -> Call:
        """The call decided: with learning, a call that names no adapter runs with the tenant's; one
        that names an adapter (LoRA or X-LoRA) runs with it and the micro-LoRA the tenant learned on
        it stacked on top (docs/adapters.md, "Stacking"); one that names another tenant's learned
        adapter is refused as if it were not loaded."""
        if adapter is not None and not may_use(tenant, adapter):
            raise AdapterNotFoundError(f"no adapter named {adapter!r} is loaded", "model")
        stacked: tuple[str, ...] = ()
        if self.learner is not None:
            if adapter is None:
                adapter = self.learner.adapter_for(tenant)
            elif not adapter.startswith(LEARNED_PREFIX):  # a learned version is a micro-LoRA already
                micro = self.learner.adapter_for(tenant, adapter)
                stacked = (micro,) if micro is not None else ()
        return Call(self, request_id, tenant, adapter, prompts, params, stacked)

    async def start(self, engine: AsyncEngine, request_id: str, tenant: str, adapter: str | None,
                    prompts: list[list[int]], params: list[SamplingParams], priority: Priority,
                    observe: Callable[[RequestOutput], None] | None = None) -> Following:
        """A call over an AsyncEngine, not started until its outputs are first read. With learning, off
        the event loop: after `ruvllm learn rollback` the lookup may wait for an update and load a version."""
        for ids, p in zip(prompts, params):  # now, so a stream's bad input is its 4xx, never a 200 then an error
            check_request(ids, p, engine.info)
        args = (request_id, tenant, adapter, prompts, params)
        call = await asyncio.to_thread(self.open, *args) if self.learner is not None else self.open(*args)
        return Following(engine, call, priority, observe)

    async def embed(self, engine: AsyncEngine, request_id: str, tenant: str, adapter: str | None,
                    prompts: list[list[int]], priority: Priority, pooling: str | None = None,
                    concurrency: int | None = None) -> list[EmbeddingOutput]:
        """Embeddings over an AsyncEngine, decided as a generation call is (tenant, adapter, the
        tenant's prefix-cache salt), with at most `concurrency` inputs in the engine at once (None:
        all). Every input is checked before any starts; leaving early (cancellation) aborts them all.
        Nothing is recorded: the learner and the witness log keep completions, and an embedding is none."""
        for ids in prompts:
            check_embed_request(ids, engine.info, pooling)
        args = (request_id, tenant, adapter, [], [])
        call = await asyncio.to_thread(self.open, *args) if self.learner is not None else self.open(*args)
        gate = asyncio.Semaphore(concurrency or max(1, len(prompts)))

        async def one(i: int) -> EmbeddingOutput:
            async with gate:
                return await engine.embed(prompts[i], f"{request_id}-{i}", priority, call.adapter, call.cache_salt,
                                          pooling, call.stacked)

        tasks = [asyncio.create_task(one(i)) for i in range(len(prompts))]
        try:
            return list(await asyncio.gather(*tasks))
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    def feedback(self, request_id: str, tenant: str, score: float, correction: str | None) -> FeedbackResult:
        """Learn from feedback on one of the tenant's completions (typed errors when refused), witnessed."""
        if self.learner is None:
            raise RuntimeError("learning is not enabled")
        result = self.learner.feedback(request_id, tenant, score, correction)
        self._witness_feedback(request_id, tenant, score, correction, result)
        return result

    def feedback_many(self, events: list[FeedbackEvent]) -> Iterator[tuple[int, FeedbackResult | Exception]]:
        """Learn a backlog of feedback events, each tenant's coalesced into steps (Learner.feedback_many):
        (index, result or the error refusing it) as each is done; every event learned is witnessed."""
        if self.learner is None:
            raise RuntimeError("learning is not enabled")
        for i, result in self.learner.feedback_many(events):
            if not isinstance(result, Exception):
                self._witness_feedback(*events[i], result)
            yield i, result

    def _witness_feedback(self, request_id: str, tenant: str, score: float, correction: str | None,
                          result: FeedbackResult) -> None:
        if self.witness is None:
            return
        from ruvllm.witness.log import token_hash

        ids = self.learner.tokenizer.encode(correction, add_special_tokens=False) if correction else None
        body = {"score": score, "correction_hash": None if ids is None else token_hash(ids),
                "adapter_version": result.version, "loss": result.loss, "step_ms": round(result.step_ms, 3)}
        if result.events > 1:  # learned in one step with others of its tenant's (a backlog coalesced)
            body["step_events"] = result.events
        self.witness.append(request_id, "feedback", tenant, body)


@dataclass
class Call:
    """One generation call as decided: one id, one tenant, one adapter (and those stacked on it), one
    or more prompts."""

    service: GenerationService
    request_id: str
    tenant: str
    adapter: str | None  # the adapter named (else, with learning, the tenant's learned version)
    prompts: list[list[int]]
    params: list[SamplingParams]
    stacked: tuple[str, ...] = ()  # added after `adapter`'s deltas: the tenant's micro-LoRA for it

    @property
    def cache_salt(self) -> str | None:
        return tenant_salt(self.tenant)

    def record(self, i: int, out: RequestOutput) -> None:
        """Prompt i's generation has ended, however it ended (a choice cut off counts as "abort")."""
        s = self.service
        choices = [(list(c.token_ids), c.finish_reason.value if c.finish_reason else "abort") for c in out.outputs]
        if s.witness is not None:
            from ruvllm.witness.records import completion_record

            body = completion_record(s.model_name, self.adapter, self.params[i], self.prompts[i], choices,
                                     s.witness_store_tokens, index=i)
            if self.stacked:  # the micro-LoRA version that ran on top of the named adapter
                body["stacked"] = list(self.stacked)
            s.witness.append(self.request_id, "completion", self.tenant, body)
        if s.learner is not None and i == 0:  # feedback names the call: its first prompt's first choice
            s.learner.remember(self.request_id, self.tenant, self.prompts[0], choices[0][0], self.adapter)


class Accumulated:
    """One prompt's DELTA outputs gathered into its whole output (text pieces are joined once, at the end)."""

    def __init__(self) -> None:
        self.first: RequestOutput | None = None
        self.finished = False
        self._choices: dict[int, tuple[list[str], CompletionOutput]] = {}

    def add(self, out: RequestOutput) -> None:
        self.first, self.finished = self.first or out, out.finished
        for c in out.outputs:
            pieces, whole = self._choices.setdefault(c.index, ([], CompletionOutput(c.index, "", [])))
            pieces.append(c.text)
            whole.token_ids.extend(c.token_ids)
            if c.logprobs is not None:
                whole.logprobs = whole.logprobs or []
                whole.logprobs.extend(c.logprobs)
            if c.finish_reason is not None:
                whole.finish_reason, whole.stop_reason = c.finish_reason, c.stop_reason

    def result(self) -> RequestOutput:
        assert self.first is not None
        outs = [replace(whole, text="".join(pieces)) for _, (pieces, whole) in sorted(self._choices.items())]
        return replace(self.first, outputs=outs, finished=self.finished)


class Following:
    """A call's engine requests followed: iterate for each prompt's DELTA outputs, tagged with its index
    (each also shown to `observe`). Gathered once, as they come (`gathered`), into the whole outputs
    (`results`, once the iteration has ended) that the final bodies, the usage and the recorder read.
    Leaving early (client gone, error) or `aclose` aborts the requests."""

    def __init__(self, engine: AsyncEngine, call: Call, priority: Priority,
                 observe: Callable[[RequestOutput], None] | None = None) -> None:
        self.call, self.observe = call, observe
        self.gathered = [Accumulated() for _ in call.prompts]
        self.results: list[RequestOutput] = []
        self._outputs = self._follow(engine, priority)  # lazy: nothing reaches the engine before it is read

    def __aiter__(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        return self._outputs

    async def aclose(self) -> None:
        await self._outputs.aclose()  # type: ignore[attr-defined]

    async def _follow(self, engine: AsyncEngine, priority: Priority) -> AsyncIterator[tuple[int, RequestOutput]]:
        call = self.call
        outputs = self._read_one(engine, priority) if len(call.prompts) == 1 else self._read_all(engine, priority)
        try:
            async with aclosing(outputs):
                async for item in outputs:
                    yield item
        finally:
            done = [(i, a.result()) for i, a in enumerate(self.gathered) if a.first is not None]
            self.results = [out for _, out in done]
            for i, out in done:
                if out.outputs:
                    call.record(i, out)

    async def _read_one(self, engine: AsyncEngine, priority: Priority) -> AsyncIterator[tuple[int, RequestOutput]]:
        """One prompt (most calls): its outputs read in place, with no task and queue between them and
        the reader (a stream's token then costs one turn of the event loop less)."""
        call = self.call
        try:
            async with aclosing(engine.generate(call.prompts[0], call.params[0], f"{call.request_id}-0", priority,
                                                OutputKind.DELTA, call.adapter, call.cache_salt, call.stacked)) as outs:
                async for out in outs:
                    self.gathered[0].add(out)
                    if self.observe is not None:
                        self.observe(out)
                    yield 0, out
        except ValueError as exc:
            if isinstance(exc, RuvllmError):
                raise
            raise RequestError(str(exc)) from exc  # the core refused the request as given

    async def _read_all(self, engine: AsyncEngine, priority: Priority) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Several prompts: each read by a task of its own, their outputs merged as they come."""
        call = self.call
        queue: asyncio.Queue[tuple[int, RequestOutput] | BaseException | None] = asyncio.Queue()  # None: one ended

        async def pump(i: int) -> None:
            try:
                async for out in engine.generate(call.prompts[i], call.params[i], f"{call.request_id}-{i}", priority,
                                                 OutputKind.DELTA, call.adapter, call.cache_salt, call.stacked):
                    self.gathered[i].add(out)
                    if self.observe is not None:
                        self.observe(out)
                    await queue.put((i, out))
                await queue.put(None)
            except asyncio.CancelledError:
                raise
            except BaseException as exc:  # forwarded to the reader
                await queue.put(exc)

        tasks = [asyncio.create_task(pump(i)) for i in range(len(call.prompts))]
        remaining = len(tasks)
        try:
            while remaining:
                item = await queue.get()
                if item is None:
                    remaining -= 1
                elif isinstance(item, ValueError) and not isinstance(item, RuvllmError):
                    raise RequestError(str(item)) from item  # the core refused the request as given
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield item
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
