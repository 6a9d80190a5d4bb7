"""What a request asks its output to match, as plain data (it travels to the engine core in a
message), and the syntax check the front runs before a request is accepted. Torch-free."""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict, defaultdict
from dataclasses import dataclass
from dataclasses import field as _field
from typing import Any, Callable, Generic, Hashable, TypeVar

KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")
# What a constraint may be, checked before xgrammar sees it: far beyond real schemas, each well under
# a second to compile here (the measurements: docs/structured.md, "Limits").
LIMITS = {"json_schema": 64 << 10, "regex": 4 << 10, "ebnf": 64 << 10}  # bytes of text
MAX_ENUM, MAX_CHOICES, MAX_DEPTH = 1024, 1024, 64  # enum entries, choice entries, JSON nesting levels


@dataclass
class StructuredOutputs:
    """Exactly one of: a JSON schema (as JSON text), any JSON object, a regex, a choice among
    strings, or an EBNF grammar (GBNF as llama.cpp writes it; the rule `root` starts it)."""

    json_schema: str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    # A thinking model's end-of-reasoning tokens: the constraint starts once the output has ended with
    # them (its reasoning is free text); None: from the first token. Not part of what compiles (key).
    after_tokens: tuple[int, ...] | None = None
    # The request field it came from, in the caller's API: an error found only in the engine (a compile
    # that fails or passes its deadline) names it. Not part of what compiles, nor of what it constrains.
    field: str = _field(default="response_format", compare=False)

    def __post_init__(self) -> None:
        if self.after_tokens is not None:
            self.after_tokens = tuple(self.after_tokens)
            if not self.after_tokens:
                raise ValueError("after_tokens must not be empty")
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
            except (json.JSONDecodeError, RecursionError) as exc:
                raise ValueError(f"json_schema is not valid JSON: {exc}") from None
            if not isinstance(schema, (dict, bool)):
                raise ValueError("json_schema must be a JSON object (a schema)")
        if self.choice is not None:
            if not isinstance(self.choice, (list, tuple)) or not self.choice or \
                    any(not isinstance(c, str) or not c for c in self.choice):
                raise ValueError("choice must be a non-empty list of non-empty strings")
            if len(self.choice) > MAX_CHOICES:
                raise ValueError(f"choice has {len(self.choice)} entries; at most {MAX_CHOICES} are taken")
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
        """Its size, then parse it as the engine will (without a tokenizer): ValueError naming the
        problem, or the limit it passes."""
        kind, text = self.ebnf_or_source()
        size = len(text.encode("utf-8", "surrogatepass"))
        if size > LIMITS[kind]:
            what = {"json_schema": "JSON schema", "regex": "regex", "ebnf": "grammar"}[kind]
            raise ValueError(f"the {what} is {size} bytes; at most {LIMITS[kind]} are taken")
        if self.json_schema is not None:
            _check_schema(json.loads(self.json_schema))
        error = _CHECKED.get((kind, text))
        if error is None:
            error = _syntax_error(kind, text)
            _CHECKED.put((kind, text), error)
        if error:
            raise ValueError(error)

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


def _check_schema(schema: Any) -> None:
    """Nesting and enums, walked without recursion (a schema nested 1,000 levels takes xgrammar's
    converter minutes: it never gets there)."""
    todo = [(schema, 1)]
    while todo:
        node, depth = todo.pop()
        if depth > MAX_DEPTH:
            raise ValueError(f"the JSON schema nests more than {MAX_DEPTH} levels deep; at most {MAX_DEPTH} are taken")
        if isinstance(node, dict):
            if isinstance(node.get("enum"), list) and len(node["enum"]) > MAX_ENUM:
                raise ValueError(f"the JSON schema has an enum of {len(node['enum'])} entries; at most {MAX_ENUM} "
                                 "are taken")
            node = list(node.values())
        if isinstance(node, list):
            todo += [(v, depth + 1) for v in node]


def _syntax_error(kind: str, text: str) -> str:
    """Why xgrammar cannot use it ("" when it can)."""
    what = {"json_schema": "JSON schema", "regex": "regex", "ebnf": "grammar"}[kind]
    try:
        grammar = _grammar(kind, text)
    except Exception as exc:  # noqa: BLE001  # xgrammar raises RuntimeError and its own kinds
        message = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        message = re.sub(r"^\[[\d:]+\] \S+:\d+: ", "", message)  # xgrammar's time and C++ source line
        return f"the {what} cannot be compiled: {message}"
    if not _matches_some_string(json.loads(grammar.serialize_json())):
        return (f"the {what} matches no string: its rules never end (a rule or $ref that always leads back "
                "to itself)")
    return ""


# xgrammar's expression kinds (Grammar.serialize_json: each expression is [kind, length, data...])
_RULE_REF, _SEQUENCE, _CHOICES, _REPEAT = 4, 5, 6, 8


def _matches_some_string(data: dict[str, Any]) -> bool:
    """Whether the grammar's root derives any string, propagated from the literals up (linear in the
    grammar): a sequence finishes once all its parts do, choices once one does, a rule once its body
    does, a repeat at once when it may repeat 0 times, else once its rule does."""
    flat, ptr, rules = data["grammar_expr_data"], data["grammar_expr_indptr"], data["rules"]
    n = len(ptr)  # expressions (each starts at ptr[e]) are nodes 0..n-1; rule r is node n + r
    need, parents = [], defaultdict(list)
    for e, (start, end) in enumerate(zip(ptr, [*ptr[1:], len(flat)])):
        kind, _, *args = flat[start:end]
        kids = args if kind in (_SEQUENCE, _CHOICES) else [n + args[0]] if kind == _RULE_REF or (
            kind == _REPEAT and args[1] > 0) else []  # literals and unknown kinds: finished
        need.append(min(len(kids), 1) if kind == _CHOICES else len(kids))
        for k in kids:
            parents[k].append(e)
    for r, rule in enumerate(rules):
        need.append(1)
        parents[rule[1]].append(n + r)
    todo = [node for node, k in enumerate(need) if k == 0]
    finished = set(todo)
    while todo:
        for p in parents[todo.pop()]:
            need[p] -= 1
            if need[p] == 0:
                finished.add(p)
                todo.append(p)
    return n + data["root_rule_id"] in finished


K, V = TypeVar("K", bound=Hashable), TypeVar("V")


class ByteBudget(Generic[K, V]):
    """Least recently used entries, bounded in count and in bytes (`size` of each entry, asked again at
    each trim: a compile's size is known once it is done); the newest entry is dropped too when it
    alone passes the budget."""

    def __init__(self, max_bytes: int, size: Callable[[K, V], int], max_entries: int = 256) -> None:
        self.max_bytes, self.size, self.max_entries = max_bytes, size, max_entries
        self.entries: OrderedDict[K, V] = OrderedDict()
        self.lock = threading.RLock()

    def get(self, key: K) -> V | None:
        with self.lock:
            if key in self.entries:
                self.entries.move_to_end(key)
            return self.entries.get(key)

    def put(self, key: K, value: V) -> None:
        with self.lock:
            self.entries[key] = value
            self.entries.move_to_end(key)
            self.trim()

    def trim(self) -> None:
        with self.lock:
            while self.entries and (len(self.entries) > self.max_entries or self.nbytes > self.max_bytes):
                self.entries.popitem(last=False)

    @property
    def nbytes(self) -> int:
        with self.lock:  # another thread may put or trim meanwhile (a CI run caught the race)
            return sum(self.size(k, v) for k, v in self.entries.items())


# the front's checks, by constraint: its text is most of an entry (64 KiB at most)
_CHECKED: ByteBudget[tuple[str, str], str] = ByteBudget(16 << 20, lambda key, error: len(key[1]) + len(error))
