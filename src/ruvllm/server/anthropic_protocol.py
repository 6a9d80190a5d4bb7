"""Anthropic Messages request bodies as pydantic models (POST /v1/messages and its count_tokens).

Every model accepts fields it does not know and ignores them (extra="allow"): Anthropic adds fields to
its clients often (Claude Code sends new ones with each release), and a schema that refused them
broke other servers the day a client updated. Content blocks stay plain dicts here: their kinds are
many and growing, so anthropic_translate.py reads the ones it serves and names the ones it cannot.
"""

from __future__ import annotations

from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field

from ruvllm.server.protocol import MAX_STOP, USER_MAX_CHARS, _Body


class _Open(BaseModel):
    model_config = ConfigDict(extra="allow")


class AnthropicMessage(_Open):
    role: Literal["user", "assistant"]
    content: Union[str, list[dict[str, Any]]]


class Metadata(_Open):
    # Names the tenant (a cache salt, a label, a witness field): bounded, as OpenAI's `user` is
    user_id: str | None = Field(None, max_length=USER_MAX_CHARS)


class ToolChoice(_Open):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class OutputFormat(_Open):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(_Open):
    format: OutputFormat | None = None  # `effort` and the like change nothing here


class CountTokensRequest(_Body):
    """What decides the prompt: the fields count_tokens reads, and messages.create's first ones."""

    model: str = Field(min_length=1)
    messages: list[AnthropicMessage] = Field(min_length=1)
    system: Union[str, list[dict[str, Any]], None] = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: ToolChoice | None = None
    # {"type": "enabled", "budget_tokens": N} / {"type": "disabled"}: a thinking model's template is
    # told (enable_thinking); the budget is not enforced apart from max_tokens
    thinking: dict[str, Any] | None = None


class MessagesRequest(CountTokensRequest):
    max_tokens: int = Field(ge=1)  # required, as Anthropic requires it
    stop_sequences: list[str] | None = Field(None, max_length=MAX_STOP)
    temperature: float | None = Field(None, ge=0, le=1)  # Anthropic's range
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=0)
    stream: bool = False
    metadata: Metadata | None = None
    output_config: OutputConfig | None = None

    @property
    def user(self) -> str | None:
        return self.metadata.user_id if self.metadata is not None else None
