"""StructuredOutputs: exactly one constraint, malformed ones named; the message that carries it to
the engine core round-trips; settings that would forbid the grammar's end are refused."""

from __future__ import annotations

import msgspec
import pytest

from ruvllm.messages import CoreRequest
from ruvllm.sampling_params import SamplingParams
from ruvllm.structured.spec import StructuredOutputs


def test_exactly_one_constraint() -> None:
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputs()
    with pytest.raises(ValueError, match="exactly one.*regex, choice"):
        StructuredOutputs(regex="a", choice=["a"])
    with pytest.raises(ValueError, match="non-empty list"):
        StructuredOutputs(choice=[])
    with pytest.raises(ValueError, match="not valid JSON"):
        StructuredOutputs(json_schema="{nope")
    assert StructuredOutputs(json_schema={"b": 1, "a": 2}).json_schema == '{"b": 1, "a": 2}'  # order kept


def test_a_choice_beyond_the_bmp_matches_itself() -> None:
    import xgrammar as xgr

    spec = StructuredOutputs(choice=["\U0001F600 yes"])
    assert spec.ebnf_or_source() == ("ebnf", 'root ::= "\U0001F600 yes"')
    grammar = xgr.Grammar.from_ebnf(spec.ebnf_or_source()[1])
    assert xgr.testing._is_grammar_accept_string(grammar, "\U0001F600 yes")


def test_a_choice_compiles_to_a_grammar_of_literals() -> None:
    spec = StructuredOutputs(choice=['say "hi"', "a\\b"])
    assert spec.ebnf_or_source() == ("ebnf", 'root ::= "say \\"hi\\"" | "a\\\\b"')
    spec.check()


def test_sampling_params_refuse_what_would_forbid_the_end() -> None:
    spec = StructuredOutputs(json_object=True)
    with pytest.raises(ValueError, match="ignore_eos"):
        SamplingParams(ignore_eos=True, structured=spec)
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(min_tokens=3, max_tokens=10, structured=spec)


def test_the_core_message_round_trips() -> None:
    params = SamplingParams(max_tokens=8, structured=StructuredOutputs(json_schema={"type": "object"}))
    cr = CoreRequest("r1", [1, 2, 3], params, [0])
    back = msgspec.msgpack.decode(msgspec.msgpack.encode(cr), type=CoreRequest)
    assert back.params.structured == params.structured


@pytest.mark.parametrize("spec, words", [
    (dict(json_schema={"type": "object", "properties": {"a": {"enum": [f"v{i}" for i in range(100_000)]}}}),
     "JSON schema is \\d+ bytes; at most 65536"),
    (dict(json_schema={"enum": [f"v{i}" for i in range(2000)]}), "enum of 2000 entries; at most 1024"),
    (dict(choice=[f"c{i}" for i in range(2000)]), "2000 entries; at most 1024"),
    (dict(regex="a" * 5000), "regex is 5000 bytes; at most 4096"),
    (dict(grammar='root ::= "' + "a" * 70000 + '"'), "grammar is 70011 bytes; at most 65536"),
    (dict(json_schema='{"type": "array", "items": ' * 100 + "{}" + "}" * 100), "nests more than 64 levels"),
    (dict(json_schema='{"items": ' * 5000 + "{}" + "}" * 5000), "not valid JSON"),
    (dict(json_schema={"type": "object", "properties": {"n": {"$ref": "#"}}, "required": ["n"]}), "matches no string"),
    (dict(json_schema={"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/a"}}}), "matches no string"),
    (dict(grammar="root ::= x\nx ::= root"), "grammar matches no string"),
    (dict(grammar='root ::= "a" root'), "grammar matches no string"),
])
def test_too_large_and_unsatisfiable_constraints_are_refused_at_once(spec, words) -> None:
    import time

    started = time.monotonic()
    with pytest.raises(ValueError, match=words):
        StructuredOutputs(**spec).check()
    assert time.monotonic() - started < 2.0


@pytest.mark.parametrize("spec", [
    dict(json_schema={"type": "object", "properties": {"n": {"$ref": "#"}}}),  # recursion with a way out
    dict(json_schema={"type": "array", "items": {"$ref": "#"}}),
    dict(grammar='root ::= "a" root | "b"'), dict(grammar="root ::= x{0,3}\nx ::= x"),
    dict(grammar="root ::= " + "(" * 500 + '"a"' + ")" * 500), dict(regex="[a-z]+"), dict(json_object=True),
])
def test_recursion_that_can_end_is_taken(spec) -> None:
    StructuredOutputs(**spec).check()


def test_the_check_cache_is_bounded_in_bytes() -> None:
    from ruvllm.structured import spec as module

    for i in range(400):  # 400 distinct schemas of ~60 kB: 24 MB of keys against the 16 MiB budget
        StructuredOutputs(json_schema={"type": "string", "description": f"{i}" + "x" * 60_000}).check()
    assert module._CHECKED.nbytes <= module._CHECKED.max_bytes


@pytest.mark.parametrize("field", ["response_format", "guided_regex", "text.format", "format"])
def test_a_constraint_the_engine_refuses_names_the_field_it_came_from(field: str) -> None:
    """A compile that fails or passes its deadline is found in the engine, long after the request's
    checks: its error names the field the client sent (it named response_format whatever it was)."""
    from ruvllm.engine.output_processor import OutputProcessor
    from ruvllm.errors import RequestError
    from ruvllm.messages import CoreOutput
    from ruvllm.outputs import OutputKind

    class Bytes:  # a tokenizer of one byte a token: all the detokenizer asks of one
        def decode(self, ids, **_):
            return bytes(ids).decode("latin-1")

        def convert_ids_to_tokens(self, ids, **_):
            return [chr(i) for i in ids]

    proc = OutputProcessor(Bytes())
    params = SamplingParams(max_tokens=4, structured=StructuredOutputs(regex="a+", field=field))
    proc.add("r1", [97, 98], "ab", params, ["r1-0"], OutputKind.DELTA)
    (error,), _ = proc.process([CoreOutput("r1-0", error="the grammar did not compile within 10 s")])
    assert isinstance(error, RequestError) and error.param == field
    assert str(error) == f"{field}: the grammar did not compile within 10 s"
