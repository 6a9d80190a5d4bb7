"""SamplingParams validation: every invalid value raises ValueError naming the field."""

from __future__ import annotations

import pytest

from ruvllm.sampling_params import SamplingParams


@pytest.mark.parametrize(("field", "kwargs"), [
    ("n", {"n": 0}),
    ("n", {"n": 1.5}),
    ("temperature", {"temperature": -1}),
    ("top_p", {"top_p": 0}),
    ("top_p", {"top_p": 1.5}),
    ("top_p", {"top_p": -0.1}),
    ("top_k", {"top_k": -2}),
    ("top_k", {"top_k": 2.5}),
    ("min_p", {"min_p": 2}),
    ("min_p", {"min_p": -0.1}),
    ("repetition_penalty", {"repetition_penalty": 0}),
    ("repetition_penalty", {"repetition_penalty": -1}),
    ("presence_penalty", {"presence_penalty": 3}),
    ("presence_penalty", {"presence_penalty": -2.5}),
    ("frequency_penalty", {"frequency_penalty": 2.01}),
    ("max_tokens", {"max_tokens": 0}),
    ("max_tokens", {"max_tokens": 2.0}),
    ("min_tokens", {"min_tokens": -1}),
    ("min_tokens", {"min_tokens": 5, "max_tokens": 4}),
    ("logprobs", {"logprobs": 21}),
    ("logprobs", {"logprobs": -1}),
    ("logit_bias", {"logit_bias": {5: 200}}),
    ("logit_bias", {"logit_bias": {5: -100.5}}),
    ("stop", {"stop": ["ok", 5]}),
    ("stop_token_ids", {"stop_token_ids": [3, -1]}),
    ("seed", {"seed": 1.5}),
])
def test_invalid_values_raise_naming_the_field(field: str, kwargs: dict) -> None:
    with pytest.raises(ValueError, match=rf"^{field}\b"):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("kwargs", [
    {"temperature": 0.0}, {"top_p": 1.0}, {"top_p": 1e-6}, {"top_k": 0}, {"top_k": 1}, {"min_p": 0.0},
    {"min_p": 1.0}, {"presence_penalty": 2.0}, {"frequency_penalty": -2.0}, {"repetition_penalty": 0.01},
    {"max_tokens": None}, {"max_tokens": 1, "min_tokens": 1}, {"min_tokens": 3, "max_tokens": None},
    {"logprobs": 0}, {"logprobs": 20}, {"logit_bias": {1: 100, 2: -100}}, {"seed": 0}, {"n": 4},
])
def test_boundary_values_are_accepted(kwargs: dict) -> None:
    SamplingParams(**kwargs)


def test_stop_string_becomes_tuple() -> None:
    p = SamplingParams(stop="x")
    assert p.stop_strings == ("x",)
    assert SamplingParams(stop=["a", "", "bc"]).stop_strings == ("a", "bc")
    assert SamplingParams().stop_strings == ()


def test_top_k_minus_one_means_off() -> None:
    p = SamplingParams(top_k=-1)
    assert p.top_k == 0
    assert not p.needs_truncation()
    assert SamplingParams(top_k=5).needs_truncation()


def test_logit_bias_keys_and_values_normalised() -> None:
    p = SamplingParams(logit_bias={"7": 3})
    assert p.logit_bias == {7: 3.0}


def test_flags() -> None:
    assert SamplingParams(temperature=0).greedy and not SamplingParams().greedy
    assert not SamplingParams().needs_penalties()
    assert SamplingParams(presence_penalty=0.1).needs_penalties()
    assert SamplingParams(repetition_penalty=1.1).needs_penalties()
    assert SamplingParams(min_p=0.05).needs_truncation() and SamplingParams(top_p=0.9).needs_truncation()


@pytest.mark.parametrize("field", ["temperature", "repetition_penalty"])
def test_nan_is_rejected(field: str) -> None:
    with pytest.raises(ValueError, match=rf"^{field}\b"):
        SamplingParams(**{field: float("nan")})


def test_scalar_non_string_stop_is_value_error() -> None:
    with pytest.raises(ValueError, match=r"^stop\b"):
        SamplingParams(stop=5)
