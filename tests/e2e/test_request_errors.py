"""Bad requests give a clear, typed error naming the problem, and leave no trace in the engine."""

from __future__ import annotations

import pytest

from ruvllm import LLM, RequestError, SamplingParams
from ruvllm.messages import CoreRequest


def test_empty_prompt(llm: LLM) -> None:
    assert llm.tokenizer.encode("") == []  # an empty text prompt reaches the check with no token ids
    with pytest.raises(RequestError, match="prompt is empty"):
        llm.generate("", SamplingParams())


def test_prompt_token_ids_out_of_vocabulary(llm: LLM) -> None:
    with pytest.raises(RequestError, match=r"out of range \[0, 49152\)"):
        llm.generate([[1, 2, 49152]])


def test_prompt_longer_than_context(llm: LLM) -> None:
    limit = llm.info.max_seq_len
    with pytest.raises(RequestError, match=f"prompt has {limit} tokens.*at most {limit}"):
        llm.generate([[5] * limit])


def test_logit_bias_and_stop_token_outside_vocabulary(llm: LLM) -> None:
    with pytest.raises(RequestError, match="token id 60000"):
        llm.generate("Hi", SamplingParams(logit_bias={60000: 1.0}))
    with pytest.raises(RequestError, match="token id 99999"):
        llm.generate("Hi", SamplingParams(stop_token_ids=[99999]))


def test_a_bad_prompt_in_a_batch_rejects_the_batch_cleanly(llm: LLM) -> None:
    with pytest.raises(RequestError):
        llm.generate(["fine", [10**6]])
    # the good request queued before the bad one was withdrawn
    assert llm.stats().idle


def test_invalid_prompt_types(llm: LLM) -> None:
    with pytest.raises(TypeError, match="prompts must be"):
        llm.generate([])
    with pytest.raises(TypeError, match="prompts must be"):
        llm.generate([1.5, 2])


def test_duplicate_request_id(llm: LLM) -> None:
    llm.core.add_request(CoreRequest("dup", [1, 2, 3], SamplingParams(max_tokens=1)))
    with pytest.raises(RequestError, match="already in use"):
        llm.core.add_request(CoreRequest("dup", [1, 2, 3], SamplingParams(max_tokens=1)))
    while llm.core.has_unfinished:
        llm.core.step()


def test_unknown_engine_setting() -> None:
    with pytest.raises(TypeError, match="unknown engine setting 'blok_size'"):
        LLM(blok_size=8)


def test_bad_dtype_and_missing_model(tmp_path) -> None:
    from ruvllm import ModelNotFoundError
    with pytest.raises(ValueError, match="dtype must be .auto. or one of"):
        LLM(dtype="float13")
    with pytest.raises(ModelNotFoundError, match="no-such-model"):
        LLM(str(tmp_path / "no-such-model"))
