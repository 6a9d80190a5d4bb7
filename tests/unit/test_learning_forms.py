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


def test_rewrites_keep_the_names_stay_near_and_do_not_repeat(tokenizer) -> None:  # noqa: ANN001
    """The question forms' filter (learning/rewrites.py): a rewrite that loses a name of the question,
    strays from it (cosine under NEAR), or says the question or a kept rewrite again (SAME or more)
    is dropped; at most n are kept, in the order written, each cut at its first line."""
    import torch

    from ruvllm.learning.rewrites import NEAR, SAME, kept_rewrites, names

    question = "What is the capital of Zorblax?"
    assert names(question, tokenizer) == ["Zorblax"]  # (made up: the tokenizer splits it; "capital" it does not)
    assert names("Who painted the Ember Portrait?", tokenizer) == ["Ember", "Portrait"]
    near = torch.tensor([1.0, 0.5])  # cosine with the question's [1, 0]: 0.894, over NEAR and under SAME
    assert NEAR < float(near @ torch.tensor([1.0, 0.0]) / near.norm()) < SAME
    vectors = {question: torch.tensor([1.0, 0.0]), "Which city is Zorblax's capital?": near,
               "Which city is the capital of Zorblax, then?": near * 2,  # the kept one again
               "What is the capital of Zorblock?": near, "Where is Zorblax?": torch.tensor([0.0, 1.0]),
               "What is Zorblax's capital city?": torch.tensor([1.0, -0.5])}
    written = ["Which city is Zorblax's capital?\nAnd more", "What is the capital of Zorblock?",
               "Which city is the capital of Zorblax, then?", "Where is Zorblax?", "What is the capital of Zorblax?",
               "What is Zorblax's capital city?", "Which city is Zorblax's capital?"]
    kept = kept_rewrites(question, written, 3, ["Zorblax"], lambda text: vectors[text])
    assert kept == ["Which city is Zorblax's capital?", "What is Zorblax's capital city?"]
    assert kept_rewrites(question, written, 1, ["Zorblax"], lambda text: vectors[text]) == kept[:1]
