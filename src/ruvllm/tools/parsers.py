"""Reading tool calls out of a model's text, one parser per format a family is trained on:

- `hermes`: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks (Hermes, Qwen2/Qwen3,
  and the default model through the system-prompt format of tools/format.py);
- `llama3_json`: Llama 3.x's JSON calls, `{"name": ..., "parameters": {...}}`, optionally after
  `<|python_tag|>`, several separated by `;`.

A parser returns the text outside the calls (None when there is none) and the calls; text that
only looks like a call (bad JSON, no name) stays text. `hold_from` says where a call may be
starting in text still streaming, so a stream (`CallStream`, whatever the API dialect) sends what
comes before it at once and the call when it is complete.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Union


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends it


def _call(obj: Any) -> ToolCall | None:
    """A call from {"name", "arguments"} (Hermes, OpenAI) or {"name", "parameters"} (Llama 3)."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


class HermesParser:
    _block = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)
    _open = "<tool_call>"

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        calls, kept, last = [], [], 0
        for m in self._block.finditer(text):
            try:
                call = _call(json.loads(m.group(1)))
            except json.JSONDecodeError:
                call = None
            if call is None:
                continue
            calls.append(call)
            kept.append(text[last:m.start()])
            last = m.end()
        kept.append(text[last:])
        content = "".join(kept).strip()
        return (content or None) if calls else text, calls

    def hold_from(self, text: str) -> int:
        i = text.find(self._open)
        if i >= 0:
            return i
        for k in range(min(len(self._open) - 1, len(text)), 0, -1):  # a marker's first characters at the end
            if text.endswith(self._open[:k]):
                return len(text) - k
        return len(text)


class Llama3JsonParser:
    _tag = "<|python_tag|>"

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        body = text.strip()
        if body.startswith(self._tag):
            body = body[len(self._tag):].strip()
        if not body.startswith("{"):
            return text, []
        calls = []
        decoder = json.JSONDecoder()
        i = 0
        while i < len(body):
            try:
                obj, end = decoder.raw_decode(body, i)
            except json.JSONDecodeError:
                return text, []
            call = _call(obj)
            if call is None:
                return text, []
            calls.append(call)
            i = end
            while i < len(body) and body[i] in " \n\t;":
                i += 1
        return None, calls

    def hold_from(self, text: str) -> int:
        stripped = text.lstrip()
        if not stripped or stripped.startswith(("{", self._tag)) or self._tag.startswith(stripped):
            return 0
        return len(text)


class JsonCallParser:
    """The output of a required or named call: the grammar made it {"name", "arguments"} or a list
    of those."""

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        try:
            obj = json.loads(text)
        except json.JSONDecodeError:
            return text, []
        calls = [_call(o) for o in (obj if isinstance(obj, list) else [obj])]
        if not calls or any(c is None for c in calls):
            return text, []
        return None, calls  # type: ignore[return-value]

    def hold_from(self, text: str) -> int:
        return 0


ToolReader = Union[HermesParser, Llama3JsonParser, JsonCallParser]
PARSERS = {"hermes": HermesParser, "llama3_json": Llama3JsonParser}


def parser_for(template: str | None, override: str | None = None) -> HermesParser | Llama3JsonParser:
    """The parser named, else the one the chat template's format says, else hermes (the format of
    tools/format.py's system prompt)."""
    if override:
        if override not in PARSERS:
            raise ValueError(f"unknown tool parser {override!r}: one of {', '.join(PARSERS)}")
        return PARSERS[override]()
    if template and ("<|python_tag|>" in template or "ipython" in template) and "<tool_call>" not in template:
        return Llama3JsonParser()
    return HermesParser()


def read_calls(reader: ToolReader | None, text: str, reason: str | None) -> tuple[str | None, list[ToolCall]] | None:
    """(content, calls) when the text of a completion that ended normally holds tool calls, else None
    (a completion cut for length may hold half a call: it stays text)."""
    if reader is None or reason != "stop":
        return None
    content, calls = reader.parse(text)
    return (content, calls) if calls else None


class CallStream:
    """One completion's text as it streams: `feed` each new piece; it answers the content that may go
    out now and, once the completion has ended holding calls, the calls (else None)."""

    def __init__(self, reader: ToolReader) -> None:
        self.reader, self.text, self.sent = reader, "", 0

    def feed(self, piece: str, finished: bool, reason: str | None) -> tuple[str, list[ToolCall] | None]:
        self.text += piece
        calls = read_calls(self.reader, self.text, reason) if finished else None
        upto = max(len(self.text) if finished and calls is None else self.reader.hold_from(self.text), self.sent)
        out, self.sent = self.text[self.sent:upto], upto
        if calls is None:
            return out, None
        # what is left of the text outside the calls (between or after them) goes too
        rest, _ = self.reader.parse(self.text[self.sent:])
        return (out + rest if rest and rest.strip() else out), calls[1]
