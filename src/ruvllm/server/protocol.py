"""OpenAI request bodies as pydantic models, and their translation into SamplingParams.

Fields OpenAI defines that change nothing here (metadata, store, ...) are accepted and
ignored; fields whose meaning we cannot honour (suffix) are a 400.
"""

from __future__ import annotations

from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, StrictInt, field_validator, model_validator

from ruvllm.sampling_params import SEED_MAX, SEED_MIN, SamplingParams
from ruvllm.structured.spec import StructuredOutputs
from ruvllm.server.errors import APIError

MAX_STOP = 16  # OpenAI's limit, and every dialect's here: each is matched against the text after every token
USER_MAX_CHARS = 256  # OpenAI's own `user` ids are short hashes; 4 MB ones filled the witness log


def _lone_surrogate_at(value: Any) -> str | None:
    """The path of the first string holding a lone UTF-16 surrogate (JSON allows "\\udfff"
    escapes that are no character), or None. Iterative: a body may nest deeper than the stack."""
    todo: list[tuple[Any, str]] = [(value, "")]
    while todo:
        item, path = todo.pop()
        if isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError:
                return path or "body"
        elif isinstance(item, dict):
            for key, sub in item.items():
                sub_path = f"{path}.{key}" if path else str(key)
                todo.append((key, sub_path))
                todo.append((sub, sub_path))
        elif isinstance(item, list):
            todo.extend((sub, f"{path}.{i}" if path else str(i)) for i, sub in enumerate(item))
    return None


def check_stop(v: str | list[str] | None) -> str | list[str] | None:
    if isinstance(v, list) and len(v) > MAX_STOP:
        raise ValueError(f"at most {MAX_STOP} stop sequences")
    return v


def with_tool_constraint(structured: StructuredOutputs | None, tool_constraint: StructuredOutputs | None,
                         other: str) -> StructuredOutputs | None:
    """The one output constraint of a request that may force a tool call (`tool_constraint`) and may
    set an output format (`structured`, the field `other`): both is a 400, as is a function whose
    parameters are no usable JSON schema."""
    if tool_constraint is None:
        return structured
    if structured is not None:
        raise APIError(400, f"a required or named tool call and {other} both constrain the output: give one",
                       "tool_choice")
    try:  # the syntax, here where the field is known (the engine checks it again offline)
        tool_constraint.check()
    except ValueError as exc:
        raise APIError(400, f"tools: a function's parameters are not a usable JSON schema: {exc}", "tools",
                       "invalid_value") from None
    return tool_constraint


class _Body(BaseModel):
    """A request body. Text that is not valid Unicode is refused before any field reads it: the
    tokenizer, the template and the response writer all need encodable text."""

    model_config = ConfigDict(extra="allow")

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, data: Any) -> Any:
        where = _lone_surrogate_at(data)
        if where is not None:
            # Raised as the API error itself (pydantic passes non-ValueErrors through) so the
            # 400 names the field.
            raise APIError(400, f"{where}: text holds a lone UTF-16 surrogate, which is not a valid "
                                "Unicode character", where, "invalid_value")
        return data


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")
    include_usage: bool | None = False


class _Sampling(_Body):
    """Sampling fields shared by chat and completions, with the extensions benchmark clients send."""

    model: str | None = None
    n: int | None = Field(1, ge=1, le=128)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    presence_penalty: float | None = Field(0.0, ge=-2, le=2)
    frequency_penalty: float | None = Field(0.0, ge=-2, le=2)
    logit_bias: dict[str, float] | None = None
    seed: int | None = Field(None, ge=SEED_MIN, le=SEED_MAX)
    stop: str | list[str] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = Field(None, ge=1)
    # Names a tenant (a label, a cache salt, a witness field): bounded, as every stored free string is
    user: str | None = Field(None, max_length=USER_MAX_CHARS)
    # Extensions (vLLM / llama.cpp clients): not in OpenAI's schema.
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0, le=1)
    repetition_penalty: float | None = Field(None, gt=0)
    ignore_eos: bool | None = False
    min_tokens: int | None = Field(0, ge=0)
    stop_token_ids: list[StrictInt] | None = None
    priority: Literal["low", "normal", "high", "critical"] | None = None
    # Structured outputs (docs/structured.md): OpenAI's response_format, and vLLM's guided_* fields
    response_format: dict[str, Any] | None = None
    guided_json: Union[dict[str, Any], str, None] = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    def structured(self) -> StructuredOutputs | None:
        """The request's output constraint, if it sets one (at most one); a 400 naming the field
        when it is malformed."""
        given: list[tuple[str, str, Any]] = []  # (field, kind, value)
        fmt = self.response_format
        if fmt is not None:
            kind = fmt.get("type")
            if kind == "json_object":
                given.append(("response_format", "json_object", True))
            elif kind == "json_schema":
                spec = fmt.get("json_schema")
                if not isinstance(spec, dict) or not isinstance(spec.get("schema"), (dict, bool)):
                    raise APIError(400, "response_format of type json_schema needs json_schema.schema, a JSON "
                                        "schema object", "response_format")
                given.append(("response_format", "json_schema", spec["schema"]))
            elif kind is None:  # OpenAI's `type` is required: a format without it must not pass unconstrained
                raise APIError(400, "response_format needs a type: text, json_object or json_schema",
                               "response_format")
            elif kind != "text":
                raise APIError(400, f"response_format type {kind!r} is not one of text, json_object, json_schema",
                               "response_format")
        given += [(name, kind, getattr(self, name)) for name, kind in (
            ("guided_json", "json_schema"), ("guided_regex", "regex"), ("guided_choice", "choice"),
            ("guided_grammar", "grammar")) if getattr(self, name) is not None]
        if not given:
            return None
        if len(given) > 1:
            names = [field for field, _, _ in given]
            raise APIError(400, f"{' and '.join(names)} both constrain the output: give one", names[-1])
        (field, kind, value), = given
        try:
            spec = StructuredOutputs(**{kind: value}, field=field)
            spec.check()  # the syntax, here where the field is known (the engine checks it again offline)
            return spec
        except ValueError as exc:
            raise APIError(400, f"{field}: {exc}", field, "invalid_value") from None

    def sampling_params(self, max_tokens: int, logprobs: int | None, prompt_logprobs: int | None = None,
                        tool_constraint: StructuredOutputs | None = None) -> SamplingParams:
        structured = with_tool_constraint(self.structured(), tool_constraint, "a response format")
        try:
            return SamplingParams(
                n=self.n or 1, temperature=1.0 if self.temperature is None else self.temperature,
                top_p=1.0 if self.top_p is None else self.top_p, top_k=self.top_k or 0, min_p=self.min_p or 0.0,
                repetition_penalty=self.repetition_penalty or 1.0, presence_penalty=self.presence_penalty or 0.0,
                frequency_penalty=self.frequency_penalty or 0.0,
                logit_bias={int(k): v for k, v in (self.logit_bias or {}).items()} or None,
                seed=self.seed, stop=self.stop, stop_token_ids=self.stop_token_ids, ignore_eos=bool(self.ignore_eos),
                max_tokens=max_tokens, min_tokens=min(self.min_tokens or 0, max_tokens), logprobs=logprobs,
                prompt_logprobs=prompt_logprobs, structured=structured,
            )
        except ValueError as exc:
            raise APIError(400, str(exc), str(exc).split(" ", 1)[0], "invalid_value") from None

    @field_validator("stop")
    @classmethod
    def _stop(cls, v: str | list[str] | None) -> str | list[str] | None:
        return check_stop(v)

    @field_validator("logit_bias")
    @classmethod
    def _bias(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        for key, val in (v or {}).items():
            if not key.lstrip("-").isdigit():
                raise ValueError(f"keys must be token ids, got {key!r}")
            if not -100 <= val <= 100:
                raise ValueError(f"values must be in [-100, 100], got {val}")
        return v


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: Union[str, list[dict[str, Any]], None] = None
    name: str | None = None

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        parts = []
        for part in self.content:
            if part.get("type") not in ("text", "input_text"):
                raise APIError(400, f"message content of type {part.get('type')!r} is not supported "
                                    "(text only)", "messages")
            parts.append(str(part.get("text", "")))
        return "".join(parts)


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[dict[str, Any]] | None = None
    tool_choice: Union[str, dict[str, Any], None] = None
    parallel_tool_calls: bool | None = None
    add_generation_prompt: bool = True
    # A thinking model's switches, handed to its chat template (server/reasoning.py): vLLM's
    # chat_template_kwargs (enable_thinking read from it) and OpenAI's reasoning_effort
    chat_template_kwargs: dict[str, Any] | None = None
    reasoning_effort: str | None = None

    def template_vars(self) -> dict[str, Any]:
        from ruvllm.server.reasoning import template_vars

        return template_vars((self.chat_template_kwargs or {}).get("enable_thinking"), self.reasoning_effort)

    def check_supported(self) -> None:
        if self.top_logprobs and not self.logprobs:
            raise APIError(400, "top_logprobs requires logprobs to be true", "top_logprobs")

    @property
    def token_limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


class CompletionRequest(_Sampling):
    prompt: Union[str, list[str], list[StrictInt], list[list[StrictInt]]]
    max_tokens: int | None = Field(16, ge=1)
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool | None = False
    best_of: int | None = Field(None, ge=1)
    suffix: str | None = None

    def check_supported(self) -> None:
        if self.suffix:
            raise APIError(400, "suffix is not supported by this server", "suffix")
        if self.best_of is not None and self.best_of != (self.n or 1):
            raise APIError(400, "best_of other than n is not supported", "best_of")

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise APIError(400, "prompt must not be empty", "prompt")
        if all(isinstance(x, int) for x in p):
            return [list(p)]  # type: ignore[arg-type]
        if all(isinstance(x, str) for x in p) or all(isinstance(x, list) for x in p):
            if any(isinstance(x, list) and not x for x in p):
                raise APIError(400, "a token-id prompt must not be empty", "prompt")
            return list(p)  # type: ignore[arg-type]
        raise APIError(400, "prompt must be a string, a list of strings, a list of token ids, "
                            "or a list of token-id lists", "prompt")

    @property
    def token_limit(self) -> int | None:
        return self.max_tokens


class TokenizeRequest(_Body):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: list[StrictInt]


class LoadLoraRequest(_Body):
    """vLLM's body for POST /v1/load_lora_adapter."""

    lora_name: str = Field(min_length=1, max_length=256)
    lora_path: str = Field(min_length=1, max_length=4096)


class UnloadLoraRequest(_Body):
    """vLLM's body for POST /v1/unload_lora_adapter (lora_int_id is accepted and not used)."""

    lora_name: str = Field(min_length=1, max_length=256)
    lora_int_id: int | None = None
