"""Random JSON schemas of the shapes people use (nested objects, arrays, enums, bounded numbers,
required fields): what the structured-output tests and benchmark check the guarantee on."""

from __future__ import annotations

import random
from typing import Any

_WORDS = ["name", "age", "city", "tags", "score", "active", "items", "id", "title", "count", "kind", "price",
          "notes", "owner", "level", "color"]


def random_schema(rng: random.Random, depth: int = 0) -> dict[str, Any]:
    """An object schema with 1-4 properties, nested at most two levels."""
    keys = rng.sample(_WORDS, rng.randint(1, 4))
    props = {k: _value(rng, depth + 1) for k in keys}
    required = [k for k in keys if rng.random() < 0.7] or keys[:1]
    return {"type": "object", "properties": props, "required": required, "additionalProperties": False}


def _value(rng: random.Random, depth: int) -> dict[str, Any]:
    kinds = ["string", "integer", "number", "boolean", "enum", "array"] + (["object"] if depth < 3 else [])
    kind = rng.choice(kinds)
    if kind == "string":
        return {"type": "string", "maxLength": rng.choice([8, 16, 32])}
    if kind == "integer":
        lo = rng.randint(-50, 50)
        return {"type": "integer", "minimum": lo, "maximum": lo + rng.randint(1, 1000)}
    if kind == "number":
        return {"type": "number", "minimum": 0, "maximum": rng.choice([1, 100, 1e6])}
    if kind == "boolean":
        return {"type": "boolean"}
    if kind == "enum":
        return {"enum": rng.sample(["red", "green", "blue", "small", "large", "yes", "no"], rng.randint(2, 4))}
    if kind == "array":
        return {"type": "array", "items": _value(rng, depth + 1), "minItems": 1, "maxItems": rng.randint(1, 3)}
    return random_schema(rng, depth)
