"""Reasoning output, the server's side (tools/reasoning.py splits the text): whether a request's
output starts inside reasoning (read off its rendered prompt), the template variables a request's
thinking settings become, and a constraint moved after the reasoning. Every dialect calls these the
same way; a model that does not think (st.reasoning None) gets None and nothing changes."""

from __future__ import annotations

import asyncio
import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ruvllm.server.errors import APIError
from ruvllm.tools.reasoning import ReasoningSplitter, ReasoningTags, opens_reasoning, split_reasoning

if TYPE_CHECKING:
    from ruvllm.sampling_params import SamplingParams
    from ruvllm.server.generation import ServerState

# OpenAI's reasoning_effort values (a template that reads it decides what each means)
EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")


@dataclass(frozen=True)
class Thinking:
    """One request's reasoning: the tags, and whether its prompt opened the reasoning."""

    tags: ReasoningTags
    inside: bool

    def splitter(self) -> ReasoningSplitter:
        return ReasoningSplitter(self.tags, self.inside)

    def split(self, text: str) -> tuple[str | None, str]:
        return split_reasoning(text, self.tags, self.inside)


async def thinking_of(st: ServerState, prompt_ids: list[int]) -> Thinking | None:
    """None for a model that does not think. The prompt is read as text (off the event loop: a long
    one takes a while) because a tag may be several tokens and a prefill may open the reasoning."""
    if st.reasoning is None:
        return None
    text = await asyncio.to_thread(st.engine.tokenizer.decode, prompt_ids, skip_special_tokens=False)
    return Thinking(st.reasoning, opens_reasoning(text, st.reasoning))


def after_reasoning(st: ServerState, params: SamplingParams, thinking: Thinking | None) -> SamplingParams:
    """A constraint on an output that starts inside reasoning starts after the reasoning's end tag
    (its tokens as the tokenizer writes the tag: one token for Qwen3's `</think>`), so the model
    reasons in free text and its answer matches. An output that starts outside is constrained from
    its first token (so a template that leaves the model to open its own reasoning gets none)."""
    if thinking is None or not thinking.inside or params.structured is None or not st.reasoning_end_ids:
        return params
    params.structured = dataclasses.replace(params.structured, after_tokens=st.reasoning_end_ids)
    return params


def template_vars(enable_thinking: Any = None, reasoning_effort: Any = None,
                  where: tuple[str, str] = ("chat_template_kwargs.enable_thinking", "reasoning_effort")
                  ) -> dict[str, Any]:
    """The template variables a request's thinking settings become (only those it sets: a template
    that reads neither renders as before); `where` names the fields in a 400. An effort of `none`
    (OpenAI's: no reasoning) is also `enable_thinking` false unless that is given: Qwen3's template
    reads only the latter."""
    out: dict[str, Any] = {}
    if enable_thinking is None and reasoning_effort == "none":
        enable_thinking = False
    if enable_thinking is not None:
        if not isinstance(enable_thinking, bool):
            raise APIError(400, f"{where[0]} must be true or false", where[0], "invalid_value")
        out["enable_thinking"] = enable_thinking
    if reasoning_effort is not None:
        if reasoning_effort not in EFFORTS:
            raise APIError(400, f"{where[1]} must be one of {', '.join(EFFORTS)}", where[1], "invalid_value")
        out["reasoning_effort"] = reasoning_effort
    return out


def reasoning_end_ids(tokenizer: Any, tags: ReasoningTags | None) -> tuple[int, ...]:
    return () if tags is None else tuple(tokenizer.encode(tags.end, add_special_tokens=False))
