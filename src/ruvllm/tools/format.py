"""Tools into the prompt, and the grammar of a required call.

A chat template that knows tools (its source uses `tools`) renders them itself, as the model was
trained; for one that does not (the default model's), the tools go into the system message in the
documented format below, the one Hermes-style models are trained on, and the model's calls are read
back by the `hermes` parser. Assistant messages that made calls and the tools' results are written
back into the conversation in the same form.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from ruvllm.structured.spec import StructuredOutputs

SYSTEM_TOOLS = """You can call functions to help with the user's request. The functions, as JSON schemas, are inside <tools></tools>:
<tools>
{tools}
</tools>
To call a function, reply with one <tool_call></tool_call> block per call, each holding a JSON object with the function's name and arguments, and nothing else:
<tool_call>
{{"name": "<function name>", "arguments": {{<the arguments>}}}}
</tool_call>"""


# With `required` and parallel calls, at most this many calls a response: enough for the multi-call
# requests people make, and a small model that repeats a call stops there, not at the token limit.
MAX_PARALLEL_CALLS = 4


class ToolError(ValueError):
    """A malformed `tools` / `tool_choice` / message: `param` names the field."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class ToolUse:
    functions: tuple[dict[str, Any], ...]  # each {"name", "description"?, "parameters"?}
    choice: str  # "auto" | "none" | "required" | a function's name
    parallel: bool = True

    @classmethod
    def from_request(cls, tools: list[Any] | None, tool_choice: Any, parallel: bool | None) -> ToolUse | None:
        if not tools:
            if tool_choice not in (None, "none", "auto"):
                raise ToolError("tool_choice needs tools", "tool_choice")
            return None
        functions = []
        for i, tool in enumerate(tools):
            fn = tool.get("function") if isinstance(tool, dict) else None
            if not isinstance(tool, dict) or tool.get("type", "function") != "function" or not isinstance(fn, dict) \
                    or not isinstance(fn.get("name"), str) or not fn["name"]:
                raise ToolError(f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}",
                                f"tools[{i}]")
            params = fn.get("parameters", {"type": "object", "properties": {}})
            if not isinstance(params, dict):
                raise ToolError(f"tools[{i}].function.parameters must be a JSON schema object", f"tools[{i}]")
            functions.append({"name": fn["name"], **({"description": fn["description"]} if fn.get("description")
                                                     else {}), "parameters": params})
        names = [f["name"] for f in functions]
        if len(set(names)) != len(names):
            raise ToolError("tools name the same function twice", "tools")
        choice = tool_choice if tool_choice is not None else "auto"
        if isinstance(choice, dict):
            name = (choice.get("function") or {}).get("name") if choice.get("type") == "function" else None
            if name not in names:
                raise ToolError(f"tool_choice names no function in tools: {name!r}", "tool_choice")
            choice = name
        elif choice not in ("auto", "none", "required"):
            raise ToolError(f"tool_choice must be auto, none, required or a function, got {choice!r}", "tool_choice")
        return cls(tuple(functions), choice, True if parallel is None else bool(parallel))

    @property
    def active(self) -> bool:
        return self.choice != "none"

    @property
    def constrained(self) -> bool:
        return self.choice not in ("auto", "none")

    def openai_tools(self) -> list[dict[str, Any]]:
        return [{"type": "function", "function": f} for f in self.functions]

    def constraint(self) -> StructuredOutputs | None:
        """With `required` or a named function, the output is the call itself, as JSON the grammar
        holds to the function's parameters: {"name", "arguments"} (the name first, so the model
        picks the function before its arguments), or a list of at most MAX_PARALLEL_CALLS of them
        when parallel calls are allowed with `required`."""
        if not self.constrained:
            return None
        fns = [f for f in self.functions if self.choice == "required" or f["name"] == self.choice]
        calls = [{"type": "object", "properties": {"name": {"const": f["name"]}, "arguments": f["parameters"]},
                  "required": ["name", "arguments"], "additionalProperties": False} for f in fns]
        one = calls[0] if len(calls) == 1 else {"anyOf": calls}
        schema = ({"type": "array", "items": one, "minItems": 1, "maxItems": MAX_PARALLEL_CALLS}
                  if self.parallel and self.choice == "required" else one)
        return StructuredOutputs(json_schema=schema, field="tools")


def template_knows_tools(template: str | None) -> bool:
    return bool(template) and "tools" in template


def prepare_messages(messages: list[dict[str, Any]], use: ToolUse | None, native: bool) -> list[dict[str, Any]]:
    """The conversation as the template should see it: with a tool-aware template, calls' arguments
    as objects (what templates serialise); otherwise the tools in the system message and the calls
    and results as text in the documented format."""
    out: list[dict[str, Any]] = []
    prev_tool = False  # the last message out is tool results written as a user message
    for m in messages:
        m = dict(m)
        calls = m.get("tool_calls")
        if calls:
            calls = [_call_dict(c, i) for i, c in enumerate(calls)]
            if native:
                m["tool_calls"] = [{"type": "function", "id": c.get("id"),
                                    "function": {"name": c["name"], "arguments": c["arguments"]}} for c in calls]
            else:
                m.pop("tool_calls")
                blocks = "\n".join("<tool_call>\n" + json.dumps({"name": c["name"], "arguments": c["arguments"]})
                                   + "\n</tool_call>" for c in calls)
                m["content"] = ((m.get("content") or "") + ("\n" if m.get("content") else "") + blocks)
        is_tool = m["role"] == "tool" and not native
        if is_tool:
            result = "<tool_response>\n" + (m.get("content") or "") + "\n</tool_response>"
            if prev_tool:
                out[-1]["content"] += "\n" + result
                continue
            m = {"role": "user", "content": result}
        prev_tool = is_tool
        out.append(m)
    if use is not None and use.active and not native:
        block = SYSTEM_TOOLS.format(tools="\n".join(json.dumps(t) for t in use.openai_tools()))
        if out and out[0]["role"] in ("system", "developer"):
            out[0] = {**out[0], "role": "system", "content": (out[0].get("content") or "") + "\n\n" + block}
        else:
            out.insert(0, {"role": "system", "content": block})
    return out


def _call_dict(call: Any, i: int) -> dict[str, Any]:
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise ToolError(f"tool_calls[{i}] must be {{\"type\": \"function\", \"function\": {{\"name\", \"arguments\"}}}}",
                        "messages")
    args = fn.get("arguments", "{}")
    if isinstance(args, str):
        try:
            args = json.loads(args or "{}")
        except json.JSONDecodeError:
            raise ToolError(f"tool_calls[{i}].function.arguments is not JSON", "messages") from None
    return {"id": call.get("id"), "name": fn["name"], "arguments": args}
