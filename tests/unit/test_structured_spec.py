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
