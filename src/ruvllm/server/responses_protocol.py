"""OpenAI Responses request bodies (POST /v1/responses) as pydantic models.

Input items are validated here into one normal form (`Item`s as dicts, in the Responses wire shape)
that is both what the prompt is rendered from and what the response store keeps, so a conversation
continued by `previous_response_id` is rendered exactly as a client resending the items would be.
Fields OpenAI defines that change nothing here (include, service_tier, prompt_cache_key, ...) are
accepted and ignored; fields whose meaning we cannot honour (background, conversation, prompt,
truncation "auto", top_logprobs) are a 400.
"""

from __future__ import annotations

import json
import secrets
from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, field_validator

from ruvllm.server.errors import APIError
from ruvllm.server.protocol import USER_MAX_CHARS, _Body

# OpenAI's own bounds on `metadata`: what a client may attach is small, and it is stored with the response
METADATA_MAX_KEYS, METADATA_KEY_CHARS, METADATA_VALUE_CHARS = 16, 64, 512

Item = dict[str, Any]  # one conversation item in the Responses wire shape (message, function_call, ...)


class _Loose(BaseModel):
    model_config = ConfigDict(extra="allow")  # ids, status and newer optional fields of the wire format


class TextPart(_Loose):
    type: Literal["input_text", "output_text"]
    text: str


class RefusalPart(_Loose):
    type: Literal["refusal"]
    refusal: str


def _part_kind(value: Any) -> str | None:
    kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
    # images and files are named, so the 400 says what was sent rather than "no such tag"
    return kind if kind in ("input_text", "output_text", "refusal") else "unsupported"


class UnsupportedPart(_Loose):
    type: str

    @field_validator("type")
    @classmethod
    def _refuse(cls, v: str) -> str:
        raise ValueError(f"content of type {v!r} is not supported (text only: input_text, output_text)")


Part = Annotated[Union[Annotated[TextPart, Tag("input_text")], Annotated[TextPart, Tag("output_text")],
                       Annotated[RefusalPart, Tag("refusal")], Annotated[UnsupportedPart, Tag("unsupported")]],
                 Discriminator(_part_kind)]


def _text_of(parts: Union[list[Part], str]) -> str:
    """A message's content or a call's output as one text: its text parts and refusals, in order."""
    if isinstance(parts, str):
        return parts
    return "".join(p.text if isinstance(p, TextPart) else p.refusal for p in parts)


class MessageItem(_Loose):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: Union[list[Part], str]

    def text(self) -> str:
        return _text_of(self.content)


class FunctionCallItem(_Loose):
    type: Literal["function_call"]
    call_id: str = Field(min_length=1)
    name: str = Field(min_length=1)
    arguments: str

    @field_validator("arguments")
    @classmethod
    def _json_object(cls, v: str) -> str:
        try:
            args = json.loads(v or "{}")
        except json.JSONDecodeError:
            raise ValueError("arguments must be a JSON object as text") from None
        if not isinstance(args, dict):
            raise ValueError("arguments must be a JSON object as text")
        return v or "{}"


class FunctionCallOutputItem(_Loose):
    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1)
    output: Union[list[Part], str]

    def text(self) -> str:
        return _text_of(self.output)


class ReasoningItem(_Loose):
    """A reasoning item a client sends back (Codex does, with every turn): accepted and left out of the
    prompt, as chat templates leave earlier turns' reasoning out."""

    type: Literal["reasoning"]


def _item_kind(value: Any) -> str:
    kind = value.get("type", "message") if isinstance(value, dict) else getattr(value, "type", "message")
    return kind if isinstance(kind, str) else "message"


InputItem = Annotated[Union[Annotated[MessageItem, Tag("message")], Annotated[FunctionCallItem, Tag("function_call")],
                            Annotated[FunctionCallOutputItem, Tag("function_call_output")],
                            Annotated[ReasoningItem, Tag("reasoning")]],
                      Discriminator(_item_kind, custom_error_type="invalid_item",
                                    custom_error_message="an input item's type must be one of message, function_call, "
                                                         "function_call_output, reasoning")]


class TextFormat(_Loose):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = Field(None, min_length=1, max_length=64)
    schema_: Union[dict[str, Any], bool, None] = Field(None, alias="schema")
    strict: bool | None = None
    description: str | None = None


class TextConfig(_Loose):
    format: TextFormat | None = None


class ResponsesRequest(_Body):
    model: str | None = None
    input: Union[list[InputItem], str]  # the list first: a bad item's error is the one reported
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Union[str, dict[str, Any], None] = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    stream: bool | None = False
    store: bool | None = True
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    # Names a tenant (keys aside), as on chat completions: bounded, as every stored free string is
    user: str | None = Field(None, max_length=USER_MAX_CHARS)
    reasoning: dict[str, Any] | None = None  # echoed; this server's models do not take an effort
    truncation: Literal["auto", "disabled"] | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)
    background: bool | None = None
    priority: Literal["low", "normal", "high", "critical"] | None = None  # our extension, as on chat

    def check_supported(self) -> None:
        """A 400 for what OpenAI defines and this server cannot do (rather than silently doing otherwise)."""
        extra = self.model_extra or {}
        for name, why in (("conversation", "conversations are not kept; use previous_response_id"),
                          ("prompt", "stored prompt templates do not exist here")):
            if extra.get(name) is not None:
                raise APIError(400, f"{name} is not supported: {why}", name, "unsupported_parameter")
        if self.background:
            raise APIError(400, "background responses are not supported", "background", "unsupported_parameter")
        if self.truncation == "auto":
            raise APIError(400, "truncation 'auto' is not supported: an input too long for the context is a 400",
                           "truncation", "unsupported_parameter")
        if self.top_logprobs:
            raise APIError(400, "top_logprobs is not supported on /v1/responses", "top_logprobs",
                           "unsupported_parameter")
        if isinstance(self.input, list) and not self.input and self.previous_response_id is None:
            raise APIError(400, "input must not be empty", "input", "invalid_value")

    @field_validator("metadata")
    @classmethod
    def _metadata(cls, v: dict[str, str] | None) -> dict[str, str] | None:
        if v is None:
            return v
        if len(v) > METADATA_MAX_KEYS:
            raise ValueError(f"at most {METADATA_MAX_KEYS} keys")
        for key, value in v.items():
            if len(key) > METADATA_KEY_CHARS or len(value) > METADATA_VALUE_CHARS:
                raise ValueError(f"keys are at most {METADATA_KEY_CHARS} characters and values at most "
                                 f"{METADATA_VALUE_CHARS}")
        return v

    def input_items(self) -> list[Item]:
        """The input in normal form: a string is one user message; content as a list of text parts."""
        if isinstance(self.input, str):
            return [normal_item(MessageItem(role="user", content=self.input))]
        return [normal_item(item) for item in self.input]


def new_id(prefix: str) -> str:
    """OpenAI's shape (`msg_...`, `fc_...`, `call_...`) with 128 random bits."""
    return f"{prefix}_{secrets.token_hex(16)}"


def normal_item(item: BaseModel) -> Item:
    """An input item as stored and rendered: messages' content as parts (input_text for the user's
    roles, output_text for the assistant's), function calls and outputs as sent, reasoning kept as sent;
    each with the id the client gave it or a new one, and a status (what GET .../input_items lists)."""
    given = (item.model_extra or {}).get("id")
    if isinstance(item, MessageItem):
        kind = "output_text" if item.role == "assistant" else "input_text"
        part = {"type": kind, "text": item.text(), **({"annotations": []} if kind == "output_text" else {})}
        out: Item = {"type": "message", "role": item.role, "content": [part]}
        prefix = "msg"
    elif isinstance(item, FunctionCallItem):
        out, prefix = {"type": "function_call", "call_id": item.call_id, "name": item.name,
                       "arguments": item.arguments}, "fc"
    elif isinstance(item, FunctionCallOutputItem):
        out, prefix = {"type": "function_call_output", "call_id": item.call_id, "output": item.text()}, "fco"
    else:
        out, prefix = item.model_dump(by_alias=True), "rs"
    return {**out, "id": given if isinstance(given, str) and given else new_id(prefix), "status": "completed"}
