"""Anthropic's Messages API (POST /v1/messages, /v1/messages/count_tokens): the routes over the
generation service. The body is translated into our chat messages, tools and SamplingParams by
anthropic_translate.py; the outputs into Anthropic's message, or its stream of named server-sent
events, by anthropic_output.py. Errors take Anthropic's shape by path (errors.py's ANTHROPIC dialect)."""

from __future__ import annotations

import asyncio
from functools import partial
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response

from ruvllm.server.anthropic_output import events, message
from ruvllm.server.anthropic_protocol import CountTokensRequest, MessagesRequest
from ruvllm.server.anthropic_translate import chat_messages, sampling_params, thinking_vars, tool_use
from ruvllm.server.generation import EnginePrompt, ServerState, check_context, state
from ruvllm.server.reasoning import after_reasoning, thinking_of
from ruvllm.server.tenants import tenant_of
from ruvllm.tools.format import ToolUse
from ruvllm.tools.parsers import JsonCallParser, ToolReader

router = APIRouter()


@router.post("/v1/messages")
async def messages(body: MessagesRequest, request: Request, st: ServerState = Depends(state)) -> Response:
    lora = st.check_model(body.model, tenant_of(request, body.user))
    tools = tool_use(body)
    prompt = EnginePrompt(await prompt_ids(st, body, tools), None)
    # max_tokens is a ceiling, as Anthropic's newer models treat it: a reply runs to the end of the
    # context window at most and then stops as model_context_window_exceeded (clients send 32000
    # and more whatever the model). Only a prompt that leaves no room at all is a 400.
    budget = min(body.max_tokens, check_context(prompt, None, st.max_len))
    thinking = await thinking_of(st, prompt.token_ids)
    params = after_reasoning(st, sampling_params(body, budget, tools), thinking)
    reader: ToolReader | None = None
    if tools is not None and tools.active:
        reader = JsonCallParser() if tools.constrained else st.tool_parser
    return await st.serve(request, [prompt], [params], "msg_", lora, partial(events, reader, body.max_tokens, thinking),
                          partial(message, reader, body.max_tokens, thinking), user=body.user, stream=body.stream)


@router.post("/v1/messages/count_tokens")
async def count_tokens(body: CountTokensRequest, request: Request, st: ServerState = Depends(state)) -> dict[str, Any]:
    """The prompt's length as messages.create would run it: the template, the system text and the tools."""
    st.check_model(body.model, tenant_of(request, None))
    return {"input_tokens": len(await prompt_ids(st, body, tool_use(body)))}


async def prompt_ids(st: ServerState, body: CountTokensRequest, tools: ToolUse | None) -> list[int]:
    msgs, prefill = chat_messages(body)
    ids = await st.chat_prompt(msgs, tools, "messages", thinking_vars(body))
    if prefill:  # the assistant's turn is open: its text follows the generation prompt, as the model wrote it
        ids += await asyncio.to_thread(st.engine.tokenizer.encode, prefill, add_special_tokens=False)
    return list(ids)
