"""Structured outputs through the real `openai` client (the default model): response_format with a
JSON schema (plain and streamed) and json_object, vLLM's guided_choice / guided_regex on
completions; a schema that cannot compile and malformed formats are 400s naming the field."""

from __future__ import annotations

import dataclasses
import json
import threading
import time
from collections.abc import Iterator

import httpx
import jsonschema
import openai
import pytest

from ruvllm import LLM
from ruvllm.core.engine_core import EngineCore
from tests.server.conftest import MODEL, RunningServer, start_server

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


# --- bounded compiles (issue 33, item 1; docs/structured.md "Limits") --------------------------------

def _nested_arrays(levels: int) -> str:
    """A schema of `levels` nested arrays, as JSON text built without recursion (json.dumps of the
    nested dict passes Python's recursion limit near 1,000 levels; a client in another language does not)."""
    return '{"type": "array", "items": ' * levels + '{"type": "string"}' + "}" * levels


def _refused(call, field: str, words: str, within: float = 10.0) -> None:
    """`call` gets a 400 naming `field` (param and message), with `words`, within `within` seconds."""
    started = time.monotonic()
    with pytest.raises(openai.BadRequestError) as err:
        call()
    elapsed = time.monotonic() - started
    body = err.value.body if isinstance(err.value.body, dict) else {}
    assert body.get("param") == field and field in body.get("message", "") and words in body["message"], body
    assert elapsed < within, (field, words, elapsed)


def test_constraints_that_would_not_compile_in_time_are_refused_at_once(server: RunningServer) -> None:
    """What took xgrammar minutes, or matches no string, is a 400 from the front's check, in well under a
    second of the server's time (a few seconds allowed on a loaded machine)."""
    client = _client(server)

    def chat(**extra):
        return lambda: client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=5, temperature=0,
                                                      **extra)

    def schema_format(schema):
        return {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}}

    enum = {"type": "object", "properties": {"v": {"enum": [f"value-{i}" for i in range(100_000)]}}}
    _refused(chat(**schema_format(enum)), "response_format", "at most 65536 are taken")  # 1.6 MB: bytes first
    small_enum = {"enum": [f"v{i}" for i in range(2000)]}  # 16 kB: under the byte limit, over the entries'
    _refused(chat(**schema_format(small_enum)), "response_format", "enum of 2000 entries; at most 1024")
    deep = json.loads(_nested_arrays(300))  # as deep as the client's json.dumps goes comfortably
    _refused(chat(**schema_format(deep)), "response_format", "nests more than 64 levels")
    # 1,000 nested arrays (2,000 JSON levels) as the guided_json string the protocol takes
    _refused(chat(extra_body={"guided_json": _nested_arrays(1000)}), "guided_json", "")
    cycle = {"type": "object", "properties": {"n": {"$ref": "#"}}, "required": ["n"]}
    _refused(chat(**schema_format(cycle)), "response_format", "matches no string")
    _refused(chat(extra_body={"guided_grammar": "root ::= x\nx ::= root"}), "guided_grammar", "matches no string")
    _refused(lambda: client.completions.create(model=MODEL, prompt="Hi", max_tokens=5, extra_body={
        "guided_grammar": "root ::= x\nx ::= root"}), "guided_grammar", "matches no string")
    out = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=4, temperature=0)
    assert out.choices[0].finish_reason in ("length", "stop")  # the server serves on


def test_a_deep_schema_sent_by_any_client_is_a_400(server: RunningServer) -> None:
    """1,000 nested arrays in response_format, as a client whose JSON encoder has no depth limit sends them
    (raw bytes): a 400 at once, not a 500, a dropped connection or minutes in xgrammar. The body (2,000
    JSON levels) is past what the server's JSON parser reads (Python's recursion limit), so the 400 is
    the body's ("There was an error parsing the body", no param) before response_format is looked at;
    300 levels, which it parses, are refused naming response_format (the test above)."""
    body = ('{"model": "%s", "max_tokens": 5, "messages": %s, "response_format": {"type": "json_schema", '
            '"json_schema": {"name": "x", "schema": %s}}}') % (MODEL, json.dumps(ASK), _nested_arrays(1000))
    started = time.monotonic()
    r = httpx.post(server.url + "/v1/chat/completions", content=body.encode(), timeout=30,
                   headers={"content-type": "application/json"})
    assert time.monotonic() - started < 10.0
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert (err["param"] == "response_format" and "nests more than 64" in err["message"]) or \
        (err["param"] is None and "parsing the body" in err["message"]), err


# seconds. A plain request takes 0.5-0.6 s here beside two busy processes, but 5 s was passed by a
# 4-token one in a quiet CI run (2 workers; session 18) and by 16-token ones at load 6-9: a request held
# behind the compile would still take the whole deadline, which this one measures.
DEADLINE = 10.0
# 8 strings of at most 200,000 characters: under 500 bytes, within every limit, and xgrammar compiles each
# such string for about 3.6 s on a quiet 2-core EPYC (16.6 s for 3 of them under load): past any deadline
# here by far. One such string alone ({"type": "string", "maxLength": 200000}) is too close to the deadline to test with.
RUNAWAY = {"type": "object", "properties": {f"p{i}": {"type": "string", "maxLength": 200000 + i} for i in range(8)},
           "required": [f"p{i}" for i in range(8)]}


class _WithCompileDeadline:
    """The shared model, its engines configured with grammar_compile_timeout = DEADLINE (what
    `ruvllm serve --grammar-compile-timeout` sets): start_server builds its engine through with_settings."""

    def __init__(self, llm: LLM) -> None:
        self.llm = llm

    def with_settings(self, cache=None, scheduler=None, speculation=None) -> LLM:
        worker = self.llm.core.executor.with_settings(cache, scheduler, speculation)
        return LLM(EngineCore(worker, dataclasses.replace(worker.config, grammar_compile_timeout=DEADLINE)),
                   self.llm.tokenizer)


@pytest.fixture(scope="module")
def deadline_server(_shared_llm: LLM) -> Iterator[RunningServer]:
    yield from start_server(_WithCompileDeadline(_shared_llm))  # type: ignore[arg-type]


def test_a_runaway_compile_ends_in_a_400_at_its_deadline(deadline_server: RunningServer) -> None:
    """A small schema that passes every size limit and compiles for most of a minute: its request gets a
    400 at the deadline naming the field the schema came in (vLLM's guided_json here: the deadline is
    found in the engine, which named response_format whatever the field, issue 33); a plain request sent
    meanwhile completes normally; the next constraint compiles."""
    client = _client(deadline_server)
    warm = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=4, temperature=0,
                                          extra_body={"guided_choice": ["yes", "no"]})
    assert warm.choices[0].message.content in ("yes", "no")  # the child is up: the deadline times the compile
    result: dict[str, object] = {}

    def runaway() -> None:
        started = time.monotonic()
        try:
            client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=4, extra_body={"guided_json": RUNAWAY})
            result["error"] = None
        except openai.BadRequestError as exc:
            result["error"] = exc
        result["elapsed"] = time.monotonic() - started

    thread = threading.Thread(target=runaway)
    thread.start()
    time.sleep(0.5)  # the compile is running
    started = time.monotonic()
    # 4 tokens: what is checked is that it is not held behind the compile
    plain = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=4, temperature=0)
    plain_s = time.monotonic() - started
    assert "elapsed" not in result, "the runaway ended before the plain request did"
    assert plain.choices[0].finish_reason in ("length", "stop") and plain.usage.completion_tokens >= 1
    assert plain_s < DEADLINE, plain_s
    thread.join(timeout=DEADLINE + 30)
    assert not thread.is_alive()
    error = result["error"]
    assert isinstance(error, openai.BadRequestError), result
    body = error.body if isinstance(error.body, dict) else {}
    assert body.get("param") == "guided_json", body
    assert body["message"].startswith("guided_json: ") and f"within {DEADLINE:g} s" in body["message"], body
    assert "response_format" not in body["message"], body
    assert DEADLINE - 0.5 < result["elapsed"] < DEADLINE + 5.0, result  # type: ignore[operator]
    after = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=4, temperature=0,
                                           extra_body={"guided_choice": ["yes", "no"]})
    assert after.choices[0].message.content in ("yes", "no")  # compiled in the replacement child
