"""Ollama's request bodies (/api/chat, /api/generate, /api/show, /api/pull) as pydantic models, and
their translation into what the generation service takes: `options` into SamplingParams, `format`
into a structured-output constraint, a model name into the served model or an adapter.

Unknown fields are ignored, as Ollama ignores them. Options that only size or place the model in
Ollama (num_gpu, num_thread, use_mmap, ...) change nothing here and are ignored too; so are the
samplers this engine does not have (`IGNORED_OPTIONS`, listed in docs/server.md)."""

from __future__ import annotations

import re
from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, StrictInt, field_validator

from ruvllm.sampling_params import SEED_MAX, SEED_MIN, SamplingParams
from ruvllm.server.errors import APIError
from ruvllm.server.generation import ServerState
from ruvllm.server.protocol import _Body, check_stop
from ruvllm.server.reasoning import template_vars
from ruvllm.structured.spec import StructuredOutputs

# Ollama's samplers that this engine does not have: accepted (clients send Ollama's defaults for
# them) and ignored. repeat_last_n is here because our repetition penalty covers the whole sequence.
IGNORED_OPTIONS = ("num_keep", "typical_p", "tfs_z", "repeat_last_n", "mirostat", "mirostat_tau", "mirostat_eta",
                   "penalize_newline")
# Go's time.ParseDuration, which Ollama reads a string keep_alive with ("5m", "1h30m", "-1s", "300ms")
_DURATION = re.compile(r"[-+]?(\d+(\.\d*)?|\.\d+)(ns|us|µs|ms|s|m|h)((\d+(\.\d*)?|\.\d+)(ns|us|µs|ms|s|m|h))*|[-+]?0")


class Options(BaseModel):
    """The runtime options this engine honours; the others pass through unread."""

    model_config = ConfigDict(extra="allow")
    num_predict: int | None = None  # -1: until the context is full; -2: Ollama's "fill the context", the same here
    num_ctx: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0)
    top_k: int | None = None  # <= 0: off (llama.cpp's meaning)
    top_p: float | None = Field(None, gt=0, le=1)
    min_p: float | None = Field(None, ge=0, le=1)
    seed: int | None = Field(None, ge=SEED_MIN, le=SEED_MAX)  # -1: a random seed (Ollama's default)
    stop: Union[str, list[str], None] = None
    repeat_penalty: float | None = Field(None, gt=0)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)

    @field_validator("num_predict")
    @classmethod
    def _num_predict(cls, v: int | None) -> int | None:
        if v is not None and (v == 0 or v < -2):
            raise ValueError("must be a positive number of tokens, or -1 / -2 (until the context is full)")
        return v

    @field_validator("stop")
    @classmethod
    def _stop(cls, v: str | list[str] | None) -> str | list[str] | None:
        return check_stop(v)

    def context(self, max_len: int) -> int:
        """The request's context: num_ctx, clamped to what the engine holds (a larger one is no error:
        Ollama's clients send their own default whatever the model)."""
        return max_len if self.num_ctx is None else min(self.num_ctx, max_len)

    def budget(self, prompt_len: int, max_len: int) -> int:
        """The completion's token budget: num_predict within the context; a 400 (as check_context words it)
        when the prompt leaves no room. Ollama would drop the conversation's oldest messages instead; we
        never cut a prompt silently."""
        ctx = self.context(max_len)
        if prompt_len >= ctx:
            raise APIError(400, f"the prompt has {prompt_len} tokens, but the context holds {ctx} (num_ctx, at most "
                                f"the model's {max_len}), leaving no room for a completion", "num_ctx",
                           "context_length_exceeded")
        room = ctx - prompt_len
        return room if self.num_predict is None or self.num_predict < 0 else min(self.num_predict, room)

    def sampling_params(self, max_tokens: int, structured: StructuredOutputs | None,
                        logprobs: int | None) -> SamplingParams:
        """Unset options take this server's defaults (those of /v1: temperature 1, no top-k/top-p, no
        penalty), not Ollama's Modelfile defaults: a model here has no Modelfile."""
        try:
            return SamplingParams(
                temperature=1.0 if self.temperature is None else self.temperature,
                top_p=1.0 if self.top_p is None else self.top_p,
                top_k=max(self.top_k or 0, 0), min_p=self.min_p or 0.0,
                repetition_penalty=self.repeat_penalty or 1.0, presence_penalty=self.presence_penalty or 0.0,
                frequency_penalty=self.frequency_penalty or 0.0,
                seed=None if self.seed == -1 else self.seed, stop=self.stop, max_tokens=max_tokens,
                logprobs=logprobs, structured=structured,
            )
        except ValueError as exc:
            field = str(exc).split(" ", 1)[0]
            raise APIError(400, f"options.{exc}", f"options.{field}", "invalid_value") from None


class _Generating(_Body):
    """What /api/chat and /api/generate share."""

    model: str = Field(min_length=1)
    stream: bool = True  # Ollama streams unless told not to
    format: Union[Literal["", "json"], dict[str, Any], None] = None
    options: Options = Field(default_factory=Options)
    keep_alive: Union[float, str, None] = None  # accepted; the one model stays loaded whatever it says
    think: Union[bool, Literal["low", "medium", "high"], None] = None
    logprobs: bool = False
    top_logprobs: int = Field(0, ge=0, le=20)

    @field_validator("keep_alive")
    @classmethod
    def _keep_alive(cls, v: float | str | None) -> float | str | None:
        if isinstance(v, str) and v and not _DURATION.fullmatch(v.strip()):
            raise ValueError(f"{v!r} is not a duration (a number of seconds, or such as \"5m\", \"1h\", \"-1\")")
        return v

    def structured(self) -> StructuredOutputs | None:
        """`format`: "json" is any JSON object; an object is a JSON schema."""
        if not self.format:
            return None
        try:
            spec = StructuredOutputs(json_object=True, field="format") if self.format == "json" else \
                StructuredOutputs(json_schema=self.format, field="format")
            spec.check()  # the syntax, here where the field is known
            return spec
        except ValueError as exc:
            raise APIError(400, f"format: {exc}", "format", "invalid_value") from None

    def check_think(self, st: ServerState) -> dict[str, Any]:
        """The template variables `think` becomes (server/reasoning.py): true or a level is
        `enable_thinking` true (a level is also `reasoning_effort`), false is false. Asking a model
        that does not think is refused as Ollama refuses it; `think: false` asks for nothing and is fine."""
        if self.think not in (None, False) and st.reasoning is None:
            raise APIError(400, f'"{self.model}" does not support thinking', "think")
        if self.think is None or st.reasoning is None:
            return {}
        return template_vars(self.think is not False, self.think if isinstance(self.think, str) else None,
                             ("think", "think"))

    def top_n(self) -> int | None:
        """SamplingParams.logprobs: the top alternatives per token, when logprobs are asked for."""
        return self.top_logprobs if self.logprobs else None


class ToolFunctionCall(BaseModel):
    model_config = ConfigDict(extra="allow")
    name: str = Field(min_length=1)
    arguments: dict[str, Any] = Field(default_factory=dict)  # an object in Ollama's dialect, never JSON text


class ToolCall(BaseModel):
    model_config = ConfigDict(extra="allow")
    function: ToolFunctionCall


class Message(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "user", "assistant", "tool"]
    content: str | None = ""
    images: list[str] | None = None
    tool_calls: list[ToolCall] | None = None
    tool_name: str | None = None
    thinking: str | None = None  # a previous turn's reasoning: not given back to the model

    def as_chat(self) -> dict[str, Any]:
        """The message as tools/format.py's prepare_messages and the chat template take it."""
        out: dict[str, Any] = {"role": self.role, "content": self.content or ""}
        if self.tool_calls:
            out["tool_calls"] = [{"type": "function", "function": {"name": c.function.name,
                                                                   "arguments": c.function.arguments}}
                                 for c in self.tool_calls]
        if self.role == "tool" and self.tool_name:
            out["name"] = self.tool_name
        return out


class ChatRequest(_Generating):
    messages: list[Message] = Field(default_factory=list)  # none: Ollama's "load the model" call
    tools: list[dict[str, Any]] | None = None

    def check_supported(self) -> None:
        for i, m in enumerate(self.messages):
            if m.images:
                raise APIError(400, f'"{self.model}" does not support images (messages.{i}.images)',
                               f"messages.{i}.images")


class GenerateRequest(_Generating):
    prompt: str = ""
    suffix: str | None = None
    system: str | None = None
    template: str | None = None
    context: list[StrictInt] | None = None  # the `context` a previous /api/generate answered
    raw: bool = False
    images: list[str] | None = None

    def check_supported(self, vocab_size: int) -> None:
        if self.suffix:
            raise APIError(400, f'"{self.model}" does not support insert (suffix)', "suffix")
        if self.template:
            # Ollama's templates are Go templates; ours are the model's Jinja chat template. A prompt
            # rendered by the client goes in with raw instead.
            raise APIError(400, "template is not supported: this server renders prompts with the model's chat "
                                "template; send a rendered prompt with raw: true instead", "template")
        if self.images:
            raise APIError(400, f'"{self.model}" does not support images', "images")
        if self.raw and (self.system or self.context):
            raise APIError(400, "raw mode does not take system or context: the prompt is used as it is", "raw")
        bad = [t for t in self.context or () if not 0 <= t < vocab_size]
        if bad:
            raise APIError(400, f"context holds token ids out of range [0, {vocab_size}): {bad[:5]}", "context")


class _Naming(_Body):
    """A body that names one model, as `model` or in the older spelling `name`."""

    model: str | None = None
    name: str | None = None

    @property
    def which(self) -> str:
        if not (self.model or self.name):
            raise APIError(400, "model is required", "model")
        return self.model or self.name  # type: ignore[return-value]


class ShowRequest(_Naming):
    verbose: bool = False


class PullRequest(_Naming):
    insecure: bool = False  # the Hub is always reached over HTTPS (or HF_ENDPOINT as set)
    stream: bool = True


def served_name(name: str) -> str:
    """Ollama names carry a tag, `:latest` when none is written; a client that adds it means the
    name without it."""
    return name[:-len(":latest")] if name.endswith(":latest") else name


def resolve_model(st: ServerState, name: str, tenant: str) -> str | None:
    """The adapter `name` chooses (None: the base model); 404 in Ollama's words for any other name,
    another tenant's learned adapter included."""
    try:
        return st.check_model(served_name(name), tenant)
    except APIError as exc:
        if exc.status == 404:
            raise APIError(404, f"model '{name}' not found", "model", "model_not_found") from None
        raise
