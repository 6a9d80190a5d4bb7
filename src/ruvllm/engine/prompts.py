"""Turning what users pass as prompts (text, token ids, chat messages) into token ids."""

from __future__ import annotations

from typing import Any, Union

PromptInput = Union[str, list[int]]


def is_token_ids(x: Any) -> bool:
    return isinstance(x, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in x) and len(x) > 0


def normalize_prompts(prompts: Any) -> list[PromptInput]:
    """One prompt or a list of them; a prompt is a string or a non-empty list of token ids."""
    if isinstance(prompts, str) or is_token_ids(prompts):
        return [prompts]
    if isinstance(prompts, (list, tuple)) and prompts and all(isinstance(p, str) or is_token_ids(p) for p in prompts):
        return list(prompts)
    raise TypeError("prompts must be a string, a list of token ids, or a non-empty list of either")


def encode_prompt(tokenizer: Any, prompt: PromptInput) -> tuple[list[int], str | None]:
    if isinstance(prompt, str):
        return list(tokenizer.encode(prompt, add_special_tokens=True)), prompt
    return list(prompt), None


NO_TEMPLATE = ("this model has no chat template (a base model): send completions instead, or give a template "
               "(`ruvllm serve --chat-template`)")


def has_chat_template(tokenizer: Any) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def render_chat(tokenizer: Any, messages: list[dict[str, Any]], chat_template: str | None = None,
                add_generation_prompt: bool = True, tools: list[dict[str, Any]] | None = None,
                variables: dict[str, Any] | None = None) -> list[int]:
    """Apply the model's chat template (or the one given) and tokenize, without adding BOS twice.
    `tools`: OpenAI-style tools, for a template that renders them; `variables`: more of the
    template's variables (a thinking model's `enable_thinking`, `reasoning_effort`)."""
    if chat_template is None and not has_chat_template(tokenizer):
        from ruvllm.errors import RequestError

        raise RequestError(NO_TEMPLATE, "messages")
    text = tokenizer.apply_chat_template(messages, chat_template=chat_template, tokenize=False,
                                         add_generation_prompt=add_generation_prompt,
                                         **({"tools": tools} if tools else {}), **(variables or {}))
    return list(tokenizer.encode(text, add_special_tokens=False))
