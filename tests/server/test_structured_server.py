"""Structured outputs through the real `openai` client (the default model): response_format with a
JSON schema (plain and streamed) and json_object, vLLM's guided_choice / guided_regex on
completions; a schema that cannot compile and malformed formats are 400s naming the field."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai

from tests.server.conftest import MODEL, RunningServer

SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                           "population": {"type": "integer", "minimum": 0}},
          "required": ["city", "population"], "additionalProperties": False}
FORMAT = {"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA, "strict": True}}
ASK = [{"role": "user", "content": "Name a city and its population, as JSON."}]


def _client(server: RunningServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)


def test_response_format_json_schema(server: RunningServer) -> None:
    client = _client(server)
    out = client.chat.completions.create(model=MODEL, messages=ASK, response_format=FORMAT, max_tokens=60,
                                         temperature=0.7, seed=1)
    assert out.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(out.choices[0].message.content), SCHEMA)
    stream = client.chat.completions.create(model=MODEL, messages=ASK, response_format=FORMAT, max_tokens=60,
                                            temperature=0.7, seed=2, stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    jsonschema.validate(json.loads(text), SCHEMA)
    obj = client.chat.completions.create(model=MODEL, messages=ASK, response_format={"type": "json_object"},
                                         max_tokens=60, temperature=0)
    assert isinstance(json.loads(obj.choices[0].message.content), dict)


def test_guided_fields_on_completions(server: RunningServer) -> None:
    client = _client(server)
    out = client.completions.create(model=MODEL, prompt="Is the sky blue? Answer:", max_tokens=5, temperature=0,
                                    extra_body={"guided_choice": ["yes", "no"]})
    assert out.choices[0].text in ("yes", "no")
    out = client.completions.create(model=MODEL, prompt="A date:", max_tokens=20, temperature=0,
                                    extra_body={"guided_regex": r"20[0-9]{2}-[01][0-9]-[0-3][0-9]"})
    assert len(out.choices[0].text) == 10 and out.choices[0].text.startswith("20")


def test_bad_formats_are_400_naming_the_field(server: RunningServer) -> None:
    cases = [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "frob"}}}},
         "response_format", "cannot be compiled"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format",
         "json_schema.schema"),
        ({"response_format": {"type": "yaml"}}, "response_format", "not one of"),
        ({"guided_regex": "([0-9]"}, "guided_regex", "regex cannot be compiled"),
        ({"guided_grammar": "root ::= ("}, "guided_grammar", "cannot be compiled"),
        ({"guided_choice": []}, "guided_choice", "non-empty"),
        ({"response_format": {"type": "json_object"}, "guided_regex": "a+"}, "guided_regex", "give one"),
        ({"response_format": FORMAT, "guided_json": SCHEMA}, "guided_json", "give one"),
        ({"response_format": {"type": "json_object"}, "ignore_eos": True}, "ignore_eos", "structured outputs"),
    ]
    for extra, param, words in cases:
        r = httpx.post(server.url + "/v1/chat/completions", timeout=30,
                       json={"model": MODEL, "messages": ASK, "max_tokens": 5, **extra})
        assert r.status_code == 400, (extra, r.text)
        err = r.json()["error"]
        assert err["param"] == param and words in err["message"], (extra, err)
