"""The core's per-step deltas turned into what callers read: text, n > 1 completions, finish reasons.

Runs in the front, beside the tokenizer. It detokenizes incrementally, matches stop strings (a match
finishes the completion here and asks the core to abort it), gathers the n completions of a request,
and hands each caller what its OutputKind asks for. A completion's finish reason is decided here
only: the core reports EOS, stop tokens and length; a stop string seen on the same token wins over
length (the text ended at the stop string).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ruvllm.engine.detokenizer import IncrementalDetokenizer
from ruvllm.errors import RequestError
from ruvllm.messages import CoreOutput
from ruvllm.outputs import CompletionOutput, OutputKind, RequestOutput
from ruvllm.request import FinishReason, Logprob
from ruvllm.sampling_params import SamplingParams


@dataclass
class _Completion:
    index: int
    detok: IncrementalDetokenizer
    want_logprobs: bool
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None
    sent_text: int = 0  # DELTA: how much has been handed out
    sent_tokens: int = 0
    finish_sent: bool = False

    @property
    def has_news(self) -> bool:
        return len(self.token_ids) > self.sent_tokens or (self.finish_reason is not None and not self.finish_sent)

    def output(self, kind: OutputKind) -> CompletionOutput:
        end = self.detok.visible_len(self.finish_reason is not None)
        if kind is OutputKind.DELTA:  # only the new part is sliced: O(new) per step, not O(text so far)
            t0, k0 = self.sent_text, self.sent_tokens
            self.sent_text, self.sent_tokens = max(end, t0), len(self.token_ids)
            self.finish_sent = self.finish_reason is not None
            return CompletionOutput(self.index, self.detok.text[t0:end], self.token_ids[k0:], self.finish_reason,
                                    self.stop_reason, self.logprobs[k0:] if self.want_logprobs else None)
        return CompletionOutput(self.index, self.detok.text[:end], list(self.token_ids), self.finish_reason,
                                self.stop_reason, list(self.logprobs) if self.want_logprobs else None)


@dataclass
class _Group:
    """One user request: its n completions share a prompt."""

    request_id: str
    prompt_token_ids: list[int]
    prompt: str | None
    kind: OutputKind
    completions: dict[str, _Completion]  # core sequence id -> completion
    prompt_logprobs: list[dict[int, Logprob]] | None
    constraint_field: str = "response_format"  # the request field its output constraint came from
    num_cached_tokens: int = 0
    queue_time: float | None = None
    prompt_logprobs_sent: bool = False

    @property
    def finished(self) -> bool:
        return all(c.finish_reason is not None for c in self.completions.values())


class OutputProcessor:
    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._groups: dict[str, _Group] = {}
        self._seq_to_group: dict[str, _Group] = {}

    def add(self, request_id: str, prompt_token_ids: list[int], prompt: str | None, params: SamplingParams,
            seq_ids: list[str], kind: OutputKind = OutputKind.CUMULATIVE) -> None:
        if request_id in self._groups or any(sid in self._seq_to_group for sid in seq_ids):
            # A clash would reach the core, where a duplicate sequence id is a broken engine.
            raise ValueError(f"request id {request_id!r} is already in use")
        completions = {
            sid: _Completion(i, IncrementalDetokenizer(self.tokenizer, prompt_token_ids, params.stop_strings,
                                                       params.include_stop_str_in_output, params.skip_special_tokens),
                             params.logprobs is not None)
            for i, sid in enumerate(seq_ids)}
        group = _Group(request_id, list(prompt_token_ids), prompt, kind, completions,
                       [] if params.prompt_logprobs is not None else None,
                       params.structured.field if params.structured is not None else "response_format")
        self._groups[request_id] = group
        for sid in seq_ids:
            self._seq_to_group[sid] = group

    def request_ids_of(self, seq_ids: list[str]) -> list[str]:
        """The requests these sequences belong to (each once; unknown ids skipped)."""
        found = {self._seq_to_group[sid].request_id: None for sid in seq_ids if sid in self._seq_to_group}
        return list(found)

    def abort(self, request_id: str) -> list[str]:
        """Forget a request; returns its sequences the core still runs (to abort there)."""
        group = self._groups.pop(request_id, None)
        if group is None:
            return []
        for sid in group.completions:
            self._seq_to_group.pop(sid, None)
        return [sid for sid, c in group.completions.items() if c.finish_reason is None]

    def abort_with_output(self, request_id: str) -> tuple[list[str], RequestOutput | None]:
        """Abort a request and give its caller a last, finished output (finish reason "abort" for
        completions still running); also returns the sequences the core still runs."""
        group = self._groups.get(request_id)
        if group is None:
            return [], None
        running = [sid for sid, c in group.completions.items() if c.finish_reason is None]
        for sid in running:
            group.completions[sid].finish_reason = FinishReason.ABORT
        return running, self._result(group)

    def process(self, outputs: list[CoreOutput]) -> tuple[list[RequestOutput | RequestError], list[str]]:
        """Apply one step's deltas. Returns the caller outputs due now, and the sequences the core
        must abort (their stop string matched, or a sibling's request failed). A request the core
        refused (CoreOutput.error) ends with a RequestError in the outputs (its `request_id` set), or
        raised here for a call that waits for all its requests at once (FINAL_ONLY: LLM.generate)."""
        changed: dict[str, _Group | RequestError] = {}
        aborts: list[str] = []
        for out in outputs:
            group = self._seq_to_group.get(out.request_id)
            if group is None:
                continue  # aborted by its caller while this step ran
            if out.error is not None:
                error = RequestError(f"{group.constraint_field}: {out.error}", group.constraint_field)
                if group.kind is OutputKind.FINAL_ONLY:
                    raise error
                error.request_id = group.request_id  # type: ignore[attr-defined]
                aborts += self.abort(group.request_id)
                changed[group.request_id] = error
                continue
            comp = group.completions[out.request_id]
            if comp.finish_reason is not None:
                continue  # finished here by a stop string; the core's abort is on the way
            if comp.index == 0:
                group.num_cached_tokens = out.num_cached_tokens
                if out.queue_time is not None:
                    group.queue_time = out.queue_time
                if out.new_prompt_logprobs and group.prompt_logprobs is not None:
                    group.prompt_logprobs.extend(out.new_prompt_logprobs)
            if self._apply(comp, out):
                aborts.append(out.request_id)
            changed[group.request_id] = group
        results: list[RequestOutput | RequestError] = []
        for group in changed.values():
            result = group if isinstance(group, RequestError) else self._result(group)
            if result is not None:
                results.append(result)
        return results, aborts

    @staticmethod
    def _apply(comp: _Completion, out: CoreOutput) -> bool:
        """Returns True when a stop string ended a completion the core still runs."""
        stop = None
        kept = 0
        for token in out.new_token_ids:  # several with speculative decoding
            comp.token_ids.append(token)
            kept += 1
            stop = comp.detok.add(token)
            if stop is not None:  # the tokens after it are dropped, as if decoded one by one
                break
        if comp.want_logprobs and out.new_logprobs:
            comp.logprobs.extend(out.new_logprobs[:kept])
        if stop is not None:
            comp.finish_reason, comp.stop_reason = FinishReason.STOP, stop
            return out.finish_reason is None
        if out.finish_reason is not None:
            comp.finish_reason, comp.stop_reason = FinishReason(out.finish_reason), out.stop_reason
        return False

    def _result(self, group: _Group) -> RequestOutput | None:
        finished = group.finished
        if finished:
            self._groups.pop(group.request_id, None)
            for sid in group.completions:
                self._seq_to_group.pop(sid, None)
        if group.kind is OutputKind.FINAL_ONLY and not finished:
            return None
        comps = list(group.completions.values())
        if group.kind is OutputKind.DELTA:
            outs = [c.output(OutputKind.DELTA) for c in comps if c.has_news]
        else:
            outs = [c.output(group.kind) for c in comps]
        prompt_lps = None
        if group.prompt_logprobs is not None and not (group.kind is OutputKind.DELTA and group.prompt_logprobs_sent):
            prompt_lps = [None, *group.prompt_logprobs]
            group.prompt_logprobs_sent = bool(outs)
        return RequestOutput(group.request_id, group.prompt_token_ids, outs, finished,
                             num_cached_tokens=group.num_cached_tokens, prompt=group.prompt,
                             prompt_logprobs=prompt_lps, queue_time=group.queue_time)
