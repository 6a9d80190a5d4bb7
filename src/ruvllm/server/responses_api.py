"""OpenAI's Responses API: POST /v1/responses, and the stored responses (GET, DELETE, input items).

A translation only, as openai_api.py is for chat: the request's items into a chat prompt (rendered by
the model's template, tools as on chat completions), its settings into SamplingParams, and the
generation service's outputs into Responses objects (responses_output.py). Stored responses live in
the app's ResponseStore, filed under the requesting tenant (docs/server.md, "OpenAI Responses")."""

from __future__ import annotations

from typing import Any, Literal

from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import Response

from ruvllm.sampling_params import SamplingParams
from ruvllm.server.errors import APIError
from ruvllm.server.generation import EnginePrompt, ServerState, check_context, state
from ruvllm.server.protocol import with_tool_constraint
from ruvllm.server.reasoning import after_reasoning, template_vars, thinking_of
from ruvllm.server.response_store import ResponseStore, StoredResponse
from ruvllm.server.responses_output import Turn
from ruvllm.server.responses_protocol import Item, ResponsesRequest, TextConfig
from ruvllm.server.tenants import tenant_of
from ruvllm.structured.spec import StructuredOutputs
from ruvllm.tools.format import ToolUse
from ruvllm.tools.parsers import JsonCallParser

router = APIRouter()


def store_of(request: Request) -> ResponseStore:
    return request.app.state.responses_store


def new_store(cfg: Any) -> ResponseStore:
    return ResponseStore(cfg.responses_store_max, cfg.responses_store_bytes, cfg.responses_store_ttl_s)


@router.post("/v1/responses")
async def create(body: ResponsesRequest, request: Request, st: ServerState = Depends(state)) -> Response:
    tenant = tenant_of(request, body.user)
    lora = st.check_model(body.model, tenant)
    body.check_supported()
    store = store_of(request)
    context: list[Item] = []
    if body.previous_response_id is not None:
        context = _stored(store, tenant, body.previous_response_id, "previous_response_id").conversation()
    items = body.input_items()
    tools = ToolUse.from_request(_chat_tools(body.tools), _chat_tool_choice(body.tool_choice), body.parallel_tool_calls)
    variables = template_vars(None, (body.reasoning or {}).get("effort"), ("reasoning", "reasoning.effort"))
    prompt = EnginePrompt(await _render(st, chat_messages(body.instructions, [*context, *items]), tools, variables),
                          None)
    try:
        max_tokens = check_context(prompt, body.max_output_tokens, st.max_len)
    except APIError as exc:  # the same 400, naming this API's fields
        exc.param = {"max_tokens": "max_output_tokens", "messages": "input"}.get(exc.param or "", exc.param)
        raise
    thinking = await thinking_of(st, prompt.token_ids)
    params = after_reasoning(st, _sampling(body, max_tokens, _text_constraint(body.text), tools), thinking)
    reader = None
    if tools is not None and tools.active:
        reader = JsonCallParser() if tools.constrained else st.tool_parser
    turn = Turn(body, tools, reader, context, items, store if body.store else None, tenant, thinking=thinking)
    return await st.serve(request, [prompt], [params], "resp_", lora, turn.events, turn.answer, user=body.user,
                          stream=bool(body.stream), priority=body.priority)


@router.get("/v1/responses/{response_id}")
async def retrieve(response_id: str, request: Request, user: str | None = None, stream: bool = False
                   ) -> dict[str, Any]:
    """`user`: the tenant, on a server where the body's `user` names it (keys aside), as on POST."""
    if stream:
        raise APIError(400, "streaming a stored response is not supported: it has already finished", "stream",
                       "unsupported_parameter")
    return _stored(store_of(request), tenant_of(request, user), response_id, "response_id").body


@router.delete("/v1/responses/{response_id}")
async def delete(response_id: str, request: Request, user: str | None = None) -> dict[str, Any]:
    if not store_of(request).delete(tenant_of(request, user), response_id):
        raise _not_found(response_id, "response_id")
    return {"id": response_id, "object": "response.deleted", "deleted": True}


@router.get("/v1/responses/{response_id}/input_items")
async def input_items(response_id: str, request: Request, user: str | None = None,
                      limit: int = Query(20, ge=1, le=100), order: Literal["asc", "desc"] = "desc",
                      after: str | None = None) -> dict[str, Any]:
    """The request's own input items (not those of the responses it continued), newest first by default."""
    items = list(_stored(store_of(request), tenant_of(request, user), response_id, "response_id").input)
    if order == "desc":
        items.reverse()
    if after is not None:
        at = next((i for i, item in enumerate(items) if item.get("id") == after), None)
        if at is None:
            raise APIError(400, f"after: no input item {after!r} in this response", "after", "invalid_value")
        items = items[at + 1:]
    page = items[:limit]
    return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None, "has_more": len(items) > limit}


def _not_found(response_id: str, param: str) -> APIError:
    # the same answer for an id that never existed, expired, was deleted, or is another tenant's
    return APIError(404, f"Response with id '{response_id}' not found.", param, "not_found")


def _stored(store: ResponseStore, tenant: str, response_id: str, param: str) -> StoredResponse:
    found = store.get(tenant, response_id)
    if found is None:
        raise _not_found(response_id, param)
    return found


def _chat_tools(tools: list[Any] | None) -> list[dict[str, Any]] | None:
    """Responses' flat function tools ({type, name, description, parameters, strict}) in chat's shape.
    `strict` changes nothing: a required or named call is always held to its parameters by a grammar,
    and an `auto` call is read as the model wrote it."""
    if tools is None:
        return None
    out = []
    for i, tool in enumerate(tools):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind != "function":
            raise APIError(400, f"tools[{i}]: only function tools are supported, not {kind!r}", f"tools[{i}]",
                           "unsupported_parameter")
        if not isinstance(tool.get("name"), str) or not tool["name"]:
            raise APIError(400, f"tools[{i}].name must be a non-empty string", f"tools[{i}].name", "invalid_value")
        fn = {key: tool[key] for key in ("name", "description", "parameters") if tool.get(key) is not None}
        out.append({"type": "function", "function": fn})
    return out


def _chat_tool_choice(choice: Any) -> Any:
    if isinstance(choice, dict):
        if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
            raise APIError(400, "tool_choice must be auto, none, required or {\"type\": \"function\", \"name\": ...}",
                           "tool_choice", "unsupported_parameter")
        return {"type": "function", "function": {"name": choice["name"]}}
    return choice


def _text_constraint(text: TextConfig | None) -> StructuredOutputs | None:
    fmt = text.format if text is not None else None
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_schema" and (fmt.name is None or not isinstance(fmt.schema_, (dict, bool))):
        raise APIError(400, "text.format of type json_schema needs a name and a schema (a JSON schema object)",
                       "text.format", "invalid_value")
    try:
        spec = StructuredOutputs(json_object=True, field="text.format") if fmt.type == "json_object" else \
            StructuredOutputs(json_schema=fmt.schema_, field="text.format")  # type: ignore[arg-type]
        spec.check()  # the syntax, here where the field is known (the engine checks it again offline)
        return spec
    except ValueError as exc:
        raise APIError(400, f"text.format: {exc}", "text.format", "invalid_value") from None


def _sampling(body: ResponsesRequest, max_tokens: int, structured: StructuredOutputs | None,
              tools: ToolUse | None) -> SamplingParams:
    structured = with_tool_constraint(structured, tools.constraint() if tools is not None else None, "text.format")
    try:
        return SamplingParams(temperature=1.0 if body.temperature is None else body.temperature,
                              top_p=1.0 if body.top_p is None else body.top_p, max_tokens=max_tokens,
                              structured=structured)
    except ValueError as exc:
        raise APIError(400, str(exc), str(exc).split(" ", 1)[0], "invalid_value") from None


def chat_messages(instructions: str | None, items: list[Item]) -> list[dict[str, Any]]:
    """The conversation as chat messages: instructions and system/developer messages as system
    (templates know that role; consecutive ones joined), function calls as the assistant's
    `tool_calls` (joined to the assistant message before them), their outputs as `tool` messages;
    reasoning items left out. An output whose call is not in the conversation is a 400, as OpenAI's."""
    msgs: list[dict[str, Any]] = []
    calls: set[str] = set()

    def add(role: str, content: str) -> None:
        if role == "system" and msgs and msgs[-1]["role"] == "system":
            msgs[-1]["content"] += "\n\n" + content
        else:
            msgs.append({"role": role, "content": content})

    if instructions:
        add("system", instructions)
    for i, item in enumerate(items):
        kind = item["type"]
        if kind == "message":
            text = "".join(p.get("text", p.get("refusal", "")) for p in item["content"])
            add("system" if item["role"] in ("system", "developer") else item["role"], text)
        elif kind == "function_call":
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}
            if msgs and msgs[-1]["role"] == "assistant":
                msgs[-1].setdefault("tool_calls", []).append(call)
            else:
                msgs.append({"role": "assistant", "content": "", "tool_calls": [call]})
            calls.add(item["call_id"])
        elif kind == "function_call_output":
            if item["call_id"] not in calls:
                raise APIError(400, f"No tool call found for function call output with call_id {item['call_id']}.",
                               f"input.{i}", "invalid_value")
            msgs.append({"role": "tool", "tool_call_id": item["call_id"], "content": item["output"]})
    return msgs


async def _render(st: ServerState, msgs: list[dict[str, Any]], tools: ToolUse | None,
                  variables: dict[str, Any] | None = None) -> list[int]:
    return await st.chat_prompt(msgs, tools, "input", variables)

