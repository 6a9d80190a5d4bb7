"""Tools into the prompt and calls out of the text: a tool-aware template renders the tools itself;
otherwise the documented system prompt carries them and past calls and results are written as
text; each parser reads its family's format and leaves what is not a call as text."""

from __future__ import annotations

import json

import pytest

from ruvllm.tools.format import ToolError, ToolUse, prepare_messages, template_knows_tools
from ruvllm.tools.parsers import HermesParser, JsonCallParser, Llama3JsonParser, parser_for

TOOL = {"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}}
CONVERSATION = [
    {"role": "user", "content": "2 + 3?"},
    {"role": "assistant", "content": None,
     "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}]},
    {"role": "tool", "tool_call_id": "c1", "content": "5"},
]
TOOLS_TEMPLATE = ("{% for t in tools %}TOOL {{ t.function.name }}\n{% endfor %}"
                  "{% for m in messages %}{{ m.role }}: {{ m.content }}"
                  "{% for c in m.tool_calls or [] %}CALL {{ c.function.name }} {{ c.function.arguments | tojson }}{% endfor %}"
                  "\n{% endfor %}")


def test_a_tool_aware_template_renders_the_tools_itself() -> None:
    from jinja2 import Template

    use = ToolUse.from_request([TOOL], "auto", None)
    assert template_knows_tools(TOOLS_TEMPLATE) and not template_knows_tools("{{ messages }}")
    msgs = prepare_messages(CONVERSATION, use, native=True)
    text = Template(TOOLS_TEMPLATE).render(messages=msgs, tools=use.openai_tools())
    assert "TOOL add" in text and 'CALL add {"a": 2, "b": 3}' in text and "tool: 5" in text


def test_without_one_the_system_prompt_carries_them() -> None:
    use = ToolUse.from_request([TOOL], "auto", None)
    msgs = prepare_messages(CONVERSATION, use, native=False)
    assert msgs[0]["role"] == "system" and '"name": "add"' in msgs[0]["content"] and "<tool_call>" in msgs[0]["content"]
    assert msgs[2]["role"] == "assistant" and json.loads(
        msgs[2]["content"].split("<tool_call>\n")[1].split("\n</tool_call>")[0]) == {"name": "add",
                                                                                   "arguments": {"a": 2, "b": 3}}
    assert msgs[3] == {"role": "user", "content": "<tool_response>\n5\n</tool_response>"}
    none = ToolUse.from_request([TOOL], "none", None)
    assert prepare_messages(CONVERSATION[:1], none, native=False) == CONVERSATION[:1]


def test_required_and_named_calls_are_constrained_to_the_schema() -> None:
    required = ToolUse.from_request([TOOL], "required", None).constraint()
    schema = json.loads(required.json_schema)
    assert schema["type"] == "array" and schema["items"]["properties"]["arguments"] == TOOL["function"]["parameters"]
    named = ToolUse.from_request([TOOL], {"type": "function", "function": {"name": "add"}}, False).constraint()
    assert json.loads(named.json_schema)["properties"]["name"] == {"const": "add"}
    assert ToolUse.from_request([TOOL], "auto", None).constraint() is None
    with pytest.raises(ToolError, match="names no function"):
        ToolUse.from_request([TOOL], {"type": "function", "function": {"name": "sub"}}, None)


def test_parsers_read_their_formats_and_leave_the_rest() -> None:
    content, calls = HermesParser().parse('Let me add.\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n'
                                          '</tool_call>')
    assert content == "Let me add." and [(c.name, json.loads(c.arguments)) for c in calls] == [("add", {"a": 1, "b": 2})]
    assert HermesParser().parse("<tool_call>not json</tool_call>") == ("<tool_call>not json</tool_call>", [])
    assert HermesParser().hold_from("so <tool_") == 3 and HermesParser().hold_from("plain") == 5
    content, calls = Llama3JsonParser().parse('<|python_tag|>{"name": "add", "parameters": {"a": 1, "b": 2}}')
    assert content is None and calls[0].name == "add"
    assert Llama3JsonParser().parse("The answer is 3.") == ("The answer is 3.", [])
    assert [c.name for c in JsonCallParser().parse('[{"name": "add", "arguments": {"a": 1, "b": 1}}]')[1]] == ["add"]
    assert isinstance(parser_for("{{ '<|python_tag|>' }} ipython"), Llama3JsonParser)
    assert isinstance(parser_for(None), HermesParser) and isinstance(parser_for(None, "llama3_json"), Llama3JsonParser)


def test_consecutive_results_are_one_user_message() -> None:
    two = CONVERSATION + [{"role": "tool", "tool_call_id": "c2", "content": "7"}]
    msgs = prepare_messages(two, None, native=False)
    assert [m["role"] for m in msgs] == ["user", "assistant", "user"]
    assert msgs[-1]["content"] == "<tool_response>\n5\n</tool_response>\n<tool_response>\n7\n</tool_response>"
