"""What a request asks its output to match, as plain data (it travels to the engine core in a
message), and the syntax check the front runs before a request is accepted. Torch-free."""

from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass
from typing import Any

KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")


@dataclass
class StructuredOutputs:
    """Exactly one of: a JSON schema (as JSON text), any JSON object, a regex, a choice among
    strings, or an EBNF grammar (GBNF as llama.cpp writes it; the rule `root` starts it)."""

    json_schema: str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None

    def __post_init__(self) -> None:
        given = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError(f"structured outputs take exactly one of {', '.join(KINDS)}; got "
                             f"{', '.join(given) or 'none'}")
        if self.json_schema is not None:
            if not isinstance(self.json_schema, str):
                # keys keep their order: the grammar generates properties in the schema's order, and
                # which comes first (a call's name before its arguments) changes what a model writes
                self.json_schema = json.dumps(self.json_schema)
            try:
                schema = json.loads(self.json_schema)
            except json.JSONDecodeError as exc:
                raise ValueError(f"json_schema is not valid JSON: {exc}") from None
            if not isinstance(schema, (dict, bool)):
                raise ValueError("json_schema must be a JSON object (a schema)")
        if self.choice is not None:
            if not isinstance(self.choice, (list, tuple)) or not self.choice or \
                    any(not isinstance(c, str) or not c for c in self.choice):
                raise ValueError("choice must be a non-empty list of non-empty strings")
            self.choice = list(self.choice)
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value.strip()):
                raise ValueError(f"{name} must be a non-empty string")

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    @property
    def key(self) -> tuple[str, str]:
        """What compiles alike: the cache key of the compiled grammar."""
        kind = self.kind
        value = getattr(self, kind)
        return kind, json.dumps(value) if kind == "choice" else str(value)

    def ebnf_or_source(self) -> tuple[str, str]:
        """(how xgrammar reads it, the text): "json_schema", "regex" or "ebnf"."""
        kind, text = self.key
        if kind == "json_object":
            return "json_schema", '{"type": "object"}'
        if kind == "choice":
            return "ebnf", "root ::= " + " | ".join(_ebnf_literal(c) for c in self.choice or [])
        return ("ebnf" if kind == "grammar" else kind), text

    def check(self) -> None:
        """Parse it as the engine will (without a tokenizer): ValueError naming the problem."""
        _check(*self.ebnf_or_source())

    def to_grammar(self) -> Any:
        """The xgrammar Grammar (no tokenizer yet): what the front checks and the core compiles."""
        return _grammar(*self.ebnf_or_source())


def _ebnf_literal(text: str) -> str:
    # JSON's string escapes (\" \\ \n \uXXXX) are GBNF's too; characters beyond the BMP stay
    # themselves (as \u escapes they would be two surrogate halves, which GBNF reads as two characters)
    return json.dumps(text, ensure_ascii=False)


def _grammar(kind: str, text: str) -> Any:
    import xgrammar as xgr

    if kind == "json_schema":
        return xgr.Grammar.from_json_schema(text, any_whitespace=False)
    if kind == "regex":
        return xgr.Grammar.from_regex(text)
    return xgr.Grammar.from_ebnf(text)


@functools.lru_cache(maxsize=256)
def _check(kind: str, text: str) -> None:
    try:
        _grammar(kind, text)
    except Exception as exc:  # noqa: BLE001  # xgrammar raises RuntimeError and its own kinds
        message = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        message = re.sub(r"^\[[\d:]+\] \S+:\d+: ", "", message)  # xgrammar's time and C++ source line
        what = {"json_schema": "JSON schema", "regex": "regex", "ebnf": "grammar"}[kind]
        raise ValueError(f"the {what} cannot be compiled: {message}") from None
