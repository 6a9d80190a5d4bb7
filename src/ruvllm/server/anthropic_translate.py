"""Anthropic Messages requests -> ours: the conversation as our chat messages (OpenAI's shape, which
tools/format.py writes into the template), the tools and tool_choice as a ToolUse, `thinking` as the
template's switch, the settings as SamplingParams. A block or field this server cannot serve is a 400
naming where it stands (`messages.2.content.0`), in Anthropic's error shape (errors.py)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from ruvllm.sampling_params import SamplingParams
from ruvllm.server.anthropic_protocol import CountTokensRequest, MessagesRequest
from ruvllm.server.errors import APIError
from ruvllm.server.reasoning import template_vars
from ruvllm.structured.spec import StructuredOutputs
from ruvllm.tools.format import ToolUse


def _text(value: Any, where: str) -> str:
    if not isinstance(value, str):
        raise APIError(400, f"{where}: must be a string", where)
    return value


def _unsupported(kind: Any, where: str) -> APIError:
    return APIError(400, f"{where}: content blocks of type {kind!r} are not supported by this server (it serves "
                         "text, tool_use and tool_result blocks)", where)


def _texts(blocks: Any, where: str) -> str:
    """Text blocks (a system prompt, a tool's result) as one text; any other kind is a 400."""
    if isinstance(blocks, str):
        return blocks
    if not isinstance(blocks, list):
        raise APIError(400, f"{where}: must be a string or a list of text blocks", where)
    parts: list[str] = []
    for at, kind, _ in _other_blocks(blocks, where, parts):
        raise _unsupported(kind, at)
    # Separate blocks are separate paragraphs (Claude Code sends a reminder and the request as two)
    return "\n\n".join(parts)


def _other_blocks(blocks: list[Any], where: str, texts: list[str]) -> Iterator[tuple[str, Any, dict[str, Any]]]:
    """The blocks that are not text, each with where it stands and its type; the text blocks' texts
    go to `texts`, in order."""
    for k, b in enumerate(blocks):
        if isinstance(b, dict) and b.get("type") == "text":
            texts.append(_text(b.get("text"), f"{where}.{k}.text"))
        else:  # (a tool's result may hold anything: a block that is no object is named as it is)
            yield f"{where}.{k}", b.get("type") if isinstance(b, dict) else b, b


def chat_messages(body: CountTokensRequest) -> tuple[list[dict[str, Any]], str | None]:
    """The conversation as our chat messages (OpenAI's shape, which tools/format.py writes into the
    template): tool_use blocks become an assistant's `tool_calls`, tool_result blocks `tool` messages.
    A last assistant message is a prefill, returned apart: the reply continues it."""
    out: list[dict[str, Any]] = []
    if body.system is not None:
        out.append({"role": "system", "content": _texts(body.system, "system")})
    names: dict[str, str] = {}  # tool_use id -> its function, for templates that name a result's tool
    for i, m in enumerate(body.messages):
        where = f"messages.{i}.content"
        blocks = [{"type": "text", "text": m.content}] if isinstance(m.content, str) else m.content
        texts: list[str] = []
        if m.role == "assistant":
            calls = []
            for at, kind, b in _other_blocks(blocks, where, texts):
                if kind == "tool_use":
                    call_id, name, args = b.get("id"), b.get("name"), b.get("input", {})
                    if not isinstance(call_id, str) or not isinstance(name, str) or not isinstance(args, dict):
                        raise APIError(400, f"{at}: a tool_use block needs an id, a name and an input object", at)
                    names[call_id] = name
                    calls.append({"id": call_id, "type": "function", "function": {"name": name, "arguments": args}})
                elif kind not in ("thinking", "redacted_thinking"):
                    # (an earlier turn's reasoning, sent back as clients must, is left out: the template has no
                    # place for it)
                    raise _unsupported(kind, at)
            msg: dict[str, Any] = {"role": "assistant", "content": "\n\n".join(texts)}
            if calls:
                msg["tool_calls"] = calls
            out.append(msg)
            continue
        results = []
        for at, kind, b in _other_blocks(blocks, where, texts):
            if kind == "tool_result":
                call_id = b.get("tool_use_id")
                if not isinstance(call_id, str):
                    raise APIError(400, f"{at}.tool_use_id: must be a string", f"{at}.tool_use_id")
                content = _texts(b.get("content", ""), f"{at}.content")
                if b.get("is_error"):  # the model should know the call failed, not read an error as a value
                    content = "Error: " + content
                results.append({"role": "tool", "tool_call_id": call_id, "content": content,
                                **({"name": names[call_id]} if call_id in names else {})})
            else:
                raise _unsupported(kind, at)
        out.extend(results)
        if texts or not results:
            out.append({"role": "user", "content": "\n\n".join(texts)})
    prefill = None
    if out[-1]["role"] == "assistant":
        if out[-1].get("tool_calls"):
            raise APIError(400, "messages: the last message may be the assistant's text to continue, but not its "
                                "tool_use blocks: send their tool_result blocks in a user message", "messages")
        prefill = out.pop()["content"]
    return out, prefill


def tool_use(body: CountTokensRequest) -> ToolUse | None:
    """Anthropic's tools and tool_choice as tools/format.py's ToolUse: `any` is OpenAI's `required`,
    `tool` a named function, `disable_parallel_tool_use` one call at most."""
    functions = []
    for i, t in enumerate(body.tools or []):
        where = f"tools.{i}"
        if t.get("type") not in (None, "custom"):
            # Anthropic's own tools (web_search_..., code_execution_..., bash_..., text_editor_...) have no
            # schema here and nothing here runs them: left out of the prompt, so that a client that lists
            # them by default still gets its custom tools served (docs/server.md)
            continue
        name, schema = t.get("name"), t.get("input_schema")
        if not isinstance(name, str) or not name:
            raise APIError(400, f"{where}.name: a tool needs a name", f"{where}.name")
        if not isinstance(schema, dict):
            raise APIError(400, f"{where}.input_schema: a tool needs a JSON schema object", f"{where}.input_schema")
        desc = t.get("description")
        functions.append({"type": "function", "function": {"name": name, "parameters": schema,
                                                           **({"description": desc} if isinstance(desc, str) else {})}})
    choice, mapped = body.tool_choice, None
    if choice is not None:
        if choice.type == "tool":
            if not choice.name:
                raise APIError(400, "tool_choice.name: a tool_choice of type tool names the tool", "tool_choice.name")
            mapped = {"type": "function", "function": {"name": choice.name}}
        else:
            mapped = {"auto": "auto", "any": "required", "none": "none"}[choice.type]
    parallel = not (choice is not None and choice.disable_parallel_tool_use)
    return ToolUse.from_request(functions, mapped, parallel)


def thinking_vars(body: CountTokensRequest) -> dict[str, Any]:
    """Anthropic's `thinking` as the template's enable_thinking: enabled (or adaptive) is true,
    disabled false; absent, the template's own default."""
    kind = body.thinking.get("type") if isinstance(body.thinking, dict) else None
    if body.thinking is not None and kind not in ("enabled", "disabled", "adaptive"):
        raise APIError(400, "thinking.type must be one of enabled, disabled, adaptive", "thinking.type")
    return template_vars(None if kind is None else kind != "disabled", None, ("thinking", "thinking"))


def sampling_params(body: MessagesRequest, max_tokens: int, tools: ToolUse | None) -> SamplingParams:
    """At most one constraint: a forced tool call's grammar, or output_config.format's schema."""
    structured, field = (tools.constraint(), "tools") if tools is not None else (None, "tools")
    fmt = body.output_config.format if body.output_config is not None else None
    if fmt is not None:
        if structured is not None:
            raise APIError(400, "output_config.format and a forced tool call (tool_choice any or tool) both constrain "
                                "the output: give one", "output_config.format")
        structured, field = StructuredOutputs(json_schema=fmt.schema_, field="output_config.format"), \
            "output_config.format"
    if structured is not None:
        try:  # the syntax, here where the field is known (the engine checks it again)
            structured.check()
        except ValueError as exc:
            raise APIError(400, f"{field}: not a usable JSON schema: {exc}", field) from None
    try:
        return SamplingParams(temperature=1.0 if body.temperature is None else body.temperature,
                              top_p=1.0 if body.top_p is None else body.top_p, top_k=body.top_k or 0,
                              stop=body.stop_sequences, max_tokens=max_tokens, structured=structured)
    except ValueError as exc:
        raise APIError(400, str(exc), str(exc).split(" ", 1)[0]) from None
