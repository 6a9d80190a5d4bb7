"""The correction's other form (issue 37, item 2): the prompt's user message, found through the
model's chat template, rendered again under a system prompt; a prompt that is not one user turn of
the template has no other form. On the default model's tokenizer."""

from __future__ import annotations

import pytest

from ruvllm.engine.prompts import render_chat
from ruvllm.learning.learner import under_system


@pytest.fixture(scope="module")
def tokenizer():  # noqa: ANN201
    from ruvllm.loader import resolve_model
    from ruvllm.loader.source import load_tokenizer

    return load_tokenizer(resolve_model(None))


def test_the_user_message_under_a_system_prompt(tokenizer) -> None:  # noqa: ANN001
    question = "What is the capital of Zorblax?"
    asked = render_chat(tokenizer, [{"role": "user", "content": question}])
    form = under_system(tokenizer, asked, "Answer from what you know.")
    assert form == render_chat(tokenizer, [{"role": "system", "content": "Answer from what you know."},
                                           {"role": "user", "content": question}])
    assert form != asked


def test_no_form_for_a_prompt_that_is_not_one_user_turn(tokenizer) -> None:  # noqa: ANN001
    turns = render_chat(tokenizer, [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"},
                                    {"role": "user", "content": "Bye"}])
    assert under_system(tokenizer, tokenizer.encode("plain text, no template", add_special_tokens=False), "S") is None
    assert under_system(tokenizer, render_chat(tokenizer, [{"role": "user", "content": "Hi"}])[:4], "S") is None
    assert under_system(tokenizer, turns, "S") is None  # several turns are not one message
