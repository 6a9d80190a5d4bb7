"""The OpenAI-compatible HTTP API over an AsyncEngine (FastAPI).

Handlers only validate, submit, await and abort: the engine thread owns the model."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
import json
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from ruvllm.engine.async_engine import AsyncEngine
from ruvllm.engine.prompts import render_chat
from ruvllm.errors import AdapterError
from ruvllm.outputs import CompletionOutput, RequestOutput
from ruvllm.request import Priority
from ruvllm.sampling_params import SamplingParams
from ruvllm.server import responses as R
from ruvllm.learning.background import lower_thread_priority
from ruvllm.learning.config import LearningConfig
from ruvllm.server.config import ServerConfig
from ruvllm.structured.spec import StructuredOutputs
from ruvllm.tools.format import ToolError, ToolUse, prepare_messages, template_knows_tools
from ruvllm.tools.parsers import JsonCallParser, ToolCall, ToolReader, parser_for
from ruvllm.server.errors import APIError, error_body, error_response, install_error_handlers
from ruvllm.server.feedback import DeepTrigger, FeedbackRequest, RateLimiter
from ruvllm.server.generation import (Accumulated, Admission, EnginePrompt, Recorder, api_error, check_context,
                                      follow)
from ruvllm.server.guards import APIKeyMiddleware, RequestLimitsMiddleware
from ruvllm.server.metrics import RequestTracker, ServerMetrics
from ruvllm.server.protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest, LoadLoraRequest,
                                   TokenizeRequest, UnloadLoraRequest, _Sampling)
from ruvllm.server.tenants import tenant_of
from ruvllm.tenants import tenant_salt
from ruvllm.witness.log import WitnessLog, token_hash
from ruvllm.witness.records import completion_record, model_digest

if TYPE_CHECKING:
    from ruvllm.learning.learner import Learner

log = logging.getLogger(__name__)


@dataclass
class _State:
    engine: AsyncEngine
    cfg: ServerConfig
    metrics: ServerMetrics
    admission: Admission
    text_of: R.TokenText
    created: int
    witness: WitnessLog | None = None
    learner: Learner | None = None
    feedback_limiter: RateLimiter | None = None
    deep: DeepTrigger | None = None
    updates: ThreadPoolExecutor | None = None  # the learner's update thread (one update at a time)
    updates_waiting: int = 0  # feedback requests in it or queued for it (the event loop alone counts)
    # Read off the chat template once: whether it renders tools itself, and how calls are read back
    native_tools: bool = False
    tool_parser: ToolReader | None = None

    @property
    def max_len(self) -> int:
        return self.engine.info.max_seq_len


def create_app(engine: AsyncEngine, cfg: ServerConfig, owns_engine: bool = False) -> FastAPI:
    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        if st.learner is not None:
            if st.updates is not None:  # an update in progress finishes before the stores close
                await asyncio.to_thread(st.updates.shutdown, True)
            await asyncio.to_thread(st.learner.close)  # its background pass may be loading into the engine
        if owns_engine:
            engine.shutdown()  # aborts what is still in flight, so every block returns
        if st.witness is not None:
            st.witness.close()  # what is queued is committed first

    app = FastAPI(title="ruvllm", lifespan=lifespan)
    st = _State(engine, cfg, ServerMetrics(lambda: engine.replicas, cfg.served_model_name),
                Admission(engine.info.max_num_seqs + cfg.max_queue), R.TokenText(engine.tokenizer), R.now())
    template = cfg.chat_template or getattr(engine.tokenizer, "chat_template", None)
    st.native_tools = template_knows_tools(template)
    st.tool_parser = parser_for(template, cfg.tool_parser)  # stateless: one serves every request
    if cfg.witness_log:
        st.witness = WitnessLog(cfg.witness_log, model_digest=lambda: model_digest(engine.info.model))
    if cfg.learning is not None:
        st.learner = _learner(engine, cfg.learning)
        st.updates = ThreadPoolExecutor(1, "ruvllm-learning", lower_thread_priority, (cfg.learning.nice,))
        st.feedback_limiter = RateLimiter(cfg.feedback_rate, cfg.feedback_burst)
        if cfg.deep_every:
            st.deep = DeepTrigger(cfg, engine.info.model, st.learner.root)
    app.state.ruvllm = st
    install_error_handlers(app)

    # The last added runs first: the key is checked before a body is read.
    app.add_middleware(RequestLimitsMiddleware, max_body_bytes=cfg.max_request_bytes,
                       read_timeout_s=cfg.request_read_timeout_s)
    if cfg.api_key or cfg.api_keys:
        keys: dict[str, str | None] = dict(cfg.api_keys)
        if cfg.api_key:
            keys[cfg.api_key] = None
        # the chat page holds no data: it asks for the key and sends it with its API calls
        app.add_middleware(APIKeyMiddleware, keys=keys, open_paths=("/health", "/", *cfg.routes_without_key))

    from importlib.resources import files

    page = files("ruvllm.server").joinpath("static/chat.html").read_text(encoding="utf-8")

    @app.get("/", include_in_schema=False)
    async def chat_page() -> Response:
        """The chat page (docs/chat-page.md): one static file shipped in the package, read once."""
        return HTMLResponse(page)

    @app.get("/health")
    async def health() -> Response:
        if engine.failure is not None:
            return error_response(503, f"engine is not running: {engine.failure}", None, "engine_failed")
        if not engine.is_alive:
            return error_response(503, "engine is not running")
        replicas = engine.replicas
        body: dict[str, Any] = {"status": "ok", "learning": st.learner is not None}
        if len(replicas) > 1:  # data parallel: which replicas serve (a restarting one is not an outage)
            body["replicas"] = [{"replica": r.index, "status": r.status, "restarts": r.restarts,
                                 **({"last_error": r.last_error} if r.last_error else {})} for r in replicas]
        return JSONResponse(body)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(st.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        # The operator's names, never a filesystem path of the host (nor an adapter's).
        base = {"id": cfg.served_model_name, "object": "model", "created": st.created, "owned_by": "ruvllm",
                "max_model_len": st.max_len, "root": cfg.served_model_name, "parent": None}
        adapters = [{**base, "id": name, "root": name, "parent": cfg.served_model_name} for name in engine.loras]
        return {"object": "list", "data": [base, *adapters]}

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(body: LoadLoraRequest) -> Response:
        if not engine.info.max_loras:
            raise APIError(400, "LoRA adapters are not enabled on this server (start it with --enable-lora or "
                                "--lora NAME=PATH)", None, "lora_disabled")
        if body.lora_name == cfg.served_model_name or body.lora_name in engine.loras:
            raise APIError(400, f"the name {body.lora_name!r} is already in use", "lora_name", "name_in_use")
        _check_lora_path(cfg, body.lora_path)
        try:
            await asyncio.to_thread(engine.load_lora, body.lora_name, body.lora_path)
        except AdapterError as exc:
            raise APIError(400, _without_host_paths(str(exc), body.lora_path), "lora_path", "invalid_adapter") from None
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(body: UnloadLoraRequest) -> Response:
        if body.lora_name not in engine.loras:
            raise APIError(404, f"no adapter named {body.lora_name!r} is loaded", "lora_name", "model_not_found")
        try:
            await asyncio.to_thread(engine.unload_lora, body.lora_name)
        except AdapterError as exc:  # unloaded by another call meanwhile
            raise APIError(404, str(exc), "lora_name", "model_not_found") from None
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")

    @app.post("/v1/feedback")
    async def feedback(request: Request, body: FeedbackRequest) -> dict[str, Any]:
        """Feedback on one of the tenant's completions, learned at once (docs/learning.md)."""
        from ruvllm.learning.learner import FeedbackError

        if st.learner is None or st.feedback_limiter is None:
            raise APIError(400, "this server does not learn from feedback (start it with --learn)", None,
                           "learning_disabled")
        who = tenant_of(request, body.user)
        if not st.feedback_limiter.allow(who):
            raise APIError(429, f"too much feedback: at most {st.cfg.feedback_rate:g} events a second per tenant",
                           None, "rate_limit_exceeded")
        if st.updates_waiting >= st.cfg.max_waiting_updates:  # the update thread is behind: say so, queue nothing
            raise APIError(429, f"learning is behind: {st.updates_waiting} feedback events wait for their update; "
                                "try again later", None, "rate_limit_exceeded")
        st.updates_waiting += 1
        try:
            result = await asyncio.get_running_loop().run_in_executor(
                st.updates, st.learner.feedback, body.id, who, body.score, body.correction)
        except FeedbackError as exc:
            raise APIError(exc.status, str(exc), exc.param, "not_found" if exc.status == 404 else "invalid_value") \
                from None
        except AdapterError as exc:  # the engine keeps no more adapters (--max-cpu-loras)
            raise APIError(503, f"the update could not be served: {exc}", None, "learning_capacity") from None
        finally:
            st.updates_waiting -= 1
        if st.witness is not None:
            correction = engine.tokenizer.encode(body.correction, add_special_tokens=False) if body.correction else None
            st.witness.append(body.id, "feedback", who, {
                "score": body.score, "correction_hash": None if correction is None else token_hash(correction),
                "adapter_version": result.version, "loss": result.loss, "step_ms": round(result.step_ms, 3)})
        if st.deep is not None:
            st.deep.feedback(who, 1.0 if body.correction else abs(body.score))
        return {"id": body.id, "object": "feedback", "status": "learned", "adapter": result.version,
                "loss": result.loss, "update_ms": round(result.step_ms, 3), "prepare_ms": round(result.prepare_ms, 3),
                "publish_ms": round(result.publish_ms, 3)}

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> dict[str, Any]:
        _check_model(st, body.model)
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "give exactly one of prompt or messages", "prompt")
        if body.messages is not None:
            ids = await _chat_ids(st, body.messages, body.add_generation_prompt)
        else:
            ids = await _off_loop(engine.tokenizer.encode, body.prompt, add_special_tokens=body.add_special_tokens)
        return {"count": len(ids), "max_model_len": st.max_len, "tokens": ids}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict[str, Any]:
        _check_model(st, body.model)
        vocab = engine.info.vocab_size
        bad = [t for t in body.tokens if not 0 <= t < vocab]
        if bad:
            raise APIError(400, f"token ids out of range [0, {vocab}): {bad[:5]}", "tokens")
        return {"prompt": await _off_loop(engine.tokenizer.decode, body.tokens)}

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, request: Request) -> Response:
        lora = _check_model(st, body.model)
        body.check_supported()
        tools = body.tool_use()
        prompt = EnginePrompt(await _chat_ids(st, body.messages, body.add_generation_prompt, cfg.chat_template,
                                              tools), None)
        max_tokens = check_context(prompt, body.token_limit, st.max_len)
        top_n = body.top_logprobs or 0
        params = _params(body, max_tokens, logprobs=top_n if body.logprobs else None,
                         tool_constraint=None if tools is None else tools.constraint())
        reader = None
        if tools is not None and tools.active:
            reader = JsonCallParser() if tools.constrained else st.tool_parser
        return await _serve(st, request, body, [prompt], [params], chat=True, top_n=top_n, lora=lora,
                            tool_reader=reader)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        lora = _check_model(st, body.model)
        body.check_supported()
        prompts = []
        for p in body.prompts():
            if isinstance(p, str):
                prompts.append(EnginePrompt(await _off_loop(engine.tokenizer.encode, p), p))
            else:
                prompts.append(EnginePrompt(list(p), None))
        budgets = [check_context(p, body.token_limit, st.max_len) for p in prompts]
        echo_lp = body.echo and body.logprobs is not None
        params = [_params(body, b, logprobs=body.logprobs, prompt_logprobs=body.logprobs if echo_lp else None)
                  for b in budgets]
        return await _serve(st, request, body, prompts, params, chat=False, top_n=body.logprobs or 0, lora=lora)

    return app


# --- helpers ---------------------------------------------------------------------------------------
def _check_model(st: _State, model: str | None) -> str | None:
    """The LoRA adapter a request's `model` names (None: the base model); 404 for an unknown name."""
    if model is None or model == st.cfg.served_model_name:
        return None
    loras = st.engine.loras
    if model in loras:
        return model
    served = ", ".join(f"`{m}`" for m in [st.cfg.served_model_name, *loras])
    raise APIError(404, f"The model `{model}` does not exist. This server serves {served}.", "model",
                   "model_not_found")


def _check_lora_path(cfg: ServerConfig, path: str) -> None:
    """403 unless the operator allowed adapters to be read from there (the folder resolved, links
    followed, so `..` and symlinks cannot lead out)."""
    if cfg.allow_any_lora_path:
        return

    def allowed(target: Path) -> bool:
        return any(target == Path(p).expanduser().resolve() for p in cfg.startup_lora_paths) or any(
            target.is_relative_to(Path(d).expanduser().resolve()) for d in cfg.lora_dirs)

    folder = Path(path).expanduser().resolve()
    if not allowed(folder):
        raise APIError(403, "this server does not load adapters from that path (the operator allows "
                            "--lora-dir folders and the paths given at start-up)", "lora_path", "path_not_allowed")
    # An X-LoRA checkpoint names the adapters it mixes: each of those must be allowed too (a load
    # that fails to read them reports that itself).
    from ruvllm.lora.xlora import xlora_expert_paths

    for expert in xlora_expert_paths(folder):
        if not (expert.resolve().is_relative_to(folder) or allowed(expert.resolve())):
            raise APIError(403, f"the X-LoRA model at {path} mixes an adapter from a path this server does not "
                                "load adapters from", "lora_path", "path_not_allowed")


def _without_host_paths(message: str, given: str) -> str:
    """An adapter error as the client may see it: the resolved host path replaced by the one given."""
    resolved = str(Path(given).expanduser())
    return message.replace(resolved, given) if resolved != given else message


async def _off_loop(fn: Any, *args: Any, **kwargs: Any) -> Any:
    """Tokenizing a long text takes long: on a worker thread the event loop keeps answering meanwhile
    (the tokenizers library releases the interpreter lock while it works)."""
    out = await asyncio.to_thread(fn, *args, **kwargs)
    return list(out) if not isinstance(out, str) else out


async def _chat_ids(st: _State, messages: list[Any], add_generation_prompt: bool,
                    template: str | None = None, tools: ToolUse | None = None) -> list[int]:
    msgs = []
    for m in messages:
        msg = {"role": m.role, "content": m.text(), **({"name": m.name} if m.name else {})}
        extra = m.model_extra or {}
        for key in ("tool_calls", "tool_call_id"):
            if extra.get(key):
                msg[key] = extra[key]
        msgs.append(msg)
    native = st.native_tools
    try:
        msgs = prepare_messages(msgs, tools, native)
        use_tools = tools.openai_tools() if tools is not None and tools.active and native else None
        return await _off_loop(render_chat, st.engine.tokenizer, msgs, template, add_generation_prompt, use_tools)
    except ToolError as exc:
        raise APIError(400, str(exc), exc.param, "invalid_value") from None
    except APIError:
        raise
    except Exception as exc:  # template errors (e.g. roles that must alternate) are the request's fault
        raise APIError(400, f"cannot apply the chat template: {exc}", "messages") from None


def _params(body: _Sampling, max_tokens: int, logprobs: int | None, prompt_logprobs: int | None = None,
            tool_constraint: StructuredOutputs | None = None) -> SamplingParams:
    structured = body.structured()
    if tool_constraint is not None:
        if structured is not None:
            raise APIError(400, "a required or named tool call and a response format both constrain the output: "
                                "give one", "tool_choice")
        try:  # the syntax, here where the field is known (as body.structured() checks its own)
            tool_constraint.check()
        except ValueError as exc:
            raise APIError(400, f"tools: a function's parameters are not a usable JSON schema: {exc}", "tools",
                           "invalid_value") from None
        structured = tool_constraint
    try:
        return SamplingParams(
            n=body.n or 1, temperature=1.0 if body.temperature is None else body.temperature,
            top_p=1.0 if body.top_p is None else body.top_p, top_k=body.top_k or 0, min_p=body.min_p or 0.0,
            repetition_penalty=body.repetition_penalty or 1.0, presence_penalty=body.presence_penalty or 0.0,
            frequency_penalty=body.frequency_penalty or 0.0,
            logit_bias={int(k): v for k, v in (body.logit_bias or {}).items()} or None,
            seed=body.seed, stop=body.stop, stop_token_ids=body.stop_token_ids, ignore_eos=bool(body.ignore_eos),
            max_tokens=max_tokens, min_tokens=min(body.min_tokens or 0, max_tokens), logprobs=logprobs,
            prompt_logprobs=prompt_logprobs, structured=structured,
        )
    except ValueError as exc:
        raise APIError(400, str(exc), str(exc).split(" ", 1)[0], "invalid_value") from None


async def _serve(st: _State, request: Request, body: Any, prompts: list[EnginePrompt],
                 params: list[SamplingParams], chat: bool, top_n: int, lora: str | None = None,
                 tool_reader: ToolReader | None = None) -> Response:
    n = params[0].n
    seqs = n * len(prompts)
    st.admission.acquire(seqs, "prompt" if len(prompts) > 1 else "n")
    rid = st.admission.next_id("chatcmpl" if chat else "cmpl")
    prio = Priority[(body.priority or "normal").upper()]
    who = tenant_of(request, body.user)
    if lora is None and st.learner is not None:
        # the tenant's learned adapter, if it has one; off the event loop: after `ruvllm learn rollback`
        # it may wait for an update in progress and load a version
        lora = await asyncio.to_thread(st.learner.adapter_for, who)
    outs = follow(st.engine, prompts, params, prio, rid, lora, _recorder(st, rid, prompts, params, lora, who),
                  cache_salt=tenant_salt(who))
    tracker = st.metrics.tracker()
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        chunks = (_stream_chat(st, body, outs, n, top_n, rid, tracker, include_usage, tool_reader) if chat
                  else _stream_completion(st, body, prompts, outs, n, top_n, rid, tracker, include_usage))
        return _Stream(_with_error_event(chunks),
                       release=lambda: st.admission.release(seqs))
    try:
        final = await _collect(outs, request, len(prompts), tracker)
    finally:
        st.admission.release(seqs)
    if final is None:
        return Response(status_code=499)  # client closed the request; nobody reads this
    if chat:
        return JSONResponse(_chat_body(st, body, final[0], top_n, rid, tool_reader))
    return JSONResponse(_completion_body(st, body, prompts, final, top_n, rid))


def _recorder(st: _State, rid: str, prompts: list[EnginePrompt], params: list[SamplingParams],
              lora: str | None, tenant: str) -> Recorder | None:
    """Each prompt's completion into the witness log, once its generation has ended."""
    witness, learner = st.witness, st.learner
    if witness is None and learner is None:
        return None

    def record(i: int, choices: list[tuple[list[int], str]]) -> None:
        if witness is not None:
            body = completion_record(st.cfg.served_model_name, lora, params[i], prompts[i].token_ids, choices,
                                     st.cfg.witness_store_tokens, index=i)
            witness.append(rid, "completion", tenant, body)
        if learner is not None and i == 0:  # feedback names the response: its first prompt's first choice
            learner.remember(rid, tenant, prompts[0].token_ids, choices[0][0], lora)

    return record


def _learner(engine: AsyncEngine, config: LearningConfig) -> Learner:
    from ruvllm.learning.learner import Learner

    tok = engine.tokenizer
    eos = tok.eos_token_id if tok.eos_token_id is not None else engine.info.eos_token_ids[0]
    return Learner(engine.info.model, engine, tok, eos, config)


class _Stream(StreamingResponse):
    """An SSE response that returns its admission slots however it ends: a client that leaves before
    the body is first read never starts the body's generator, so its `finally` cannot be relied on."""

    def __init__(self, chunks: AsyncIterator[str], release: Any) -> None:
        super().__init__(chunks, media_type="text/event-stream")
        self._release = release

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._release()
            await self.body_iterator.aclose()  # type: ignore[attr-defined]  # aborts the engine requests


async def _with_error_event(chunks: AsyncIterator[str]) -> AsyncIterator[str]:
    """An error mid-stream becomes an error event and [DONE] (the status line is long gone), as
    OpenAI's streams report them; a stream never just stops."""
    try:
        async for c in chunks:
            yield c
    except Exception as exc:
        err = api_error(exc)
        if not isinstance(err, APIError):
            log.exception("stream failed")
            err = APIError(500, f"internal error: {type(exc).__name__}: {exc}")
        yield _sse(error_body(err.status, err.message, err.param, err.code))
        yield "data: [DONE]\n\n"
    finally:
        await chunks.aclose()  # type: ignore[attr-defined]


async def _collect(outs: AsyncIterator[tuple[int, RequestOutput]], request: Request, num_prompts: int,
                   tracker: RequestTracker) -> list[RequestOutput] | None:
    """Wait for the final outputs; None if the client went away first (its requests are aborted)."""
    acc = [Accumulated() for _ in range(num_prompts)]

    async def consume() -> None:
        async for i, out in outs:
            tracker.on_output(sum(len(c.token_ids) for c in out.outputs), out.queue_time)
            acc[i].add(out)

    task = asyncio.create_task(consume())
    gone = False
    try:
        while not task.done():
            await asyncio.wait({task}, timeout=0.25)
            if not task.done() and await request.is_disconnected():
                gone = True
                break
    finally:
        if not task.done():
            task.cancel()  # raises inside the output stream, which aborts every engine request
        try:
            await task
        except asyncio.CancelledError:
            if not gone:
                raise
    if gone:
        return None
    results = [a.result() for a in acc]
    _finish_metrics(tracker, results)
    return results


def _finish_metrics(tracker: RequestTracker, results: list[RequestOutput]) -> None:
    tracker.on_finish(sum(len(r.prompt_token_ids) for r in results),
                      sum(len(c.token_ids) for r in results for c in r.outputs),
                      [c.finish_reason.value for r in results for c in r.outputs if c.finish_reason])


def _reason(c: CompletionOutput) -> str | None:
    return c.finish_reason.value if c.finish_reason is not None else None


def _usage(results: list[RequestOutput]) -> dict[str, Any]:
    return R.usage(sum(len(r.prompt_token_ids) for r in results),
                   sum(len(c.token_ids) for r in results for c in r.outputs),
                   sum(r.num_cached_tokens for r in results))


def _chat_body(st: _State, body: ChatCompletionRequest, out: RequestOutput, top_n: int, rid: str,
               reader: ToolReader | None = None) -> dict[str, Any]:
    choices = []
    for c in out.outputs:
        lps = R.chat_logprobs(c.token_ids, c.logprobs or [], top_n, st.text_of) if body.logprobs else None
        message: dict[str, Any] = {"role": "assistant", "content": c.text, "refusal": None}
        reason = _reason(c)
        calls = _read_calls(reader, c.text, reason)
        if calls is not None:
            message["content"], message["tool_calls"], reason = calls[0], [_call_json(k) for k in calls[1]], "tool_calls"
        choices.append({"index": c.index, "message": message, "logprobs": lps, "finish_reason": reason})
    return {"id": rid, "object": "chat.completion", "created": R.now(), "model": st.cfg.served_model_name,
            "choices": choices, "usage": _usage([out])}


def _completion_body(st: _State, body: CompletionRequest, prompts: list[EnginePrompt], results: list[RequestOutput],
                     top_n: int, rid: str) -> dict[str, Any]:
    choices = []
    for pi, (p, out) in enumerate(zip(prompts, results)):
        prefix = _echo_text(st, p) if body.echo else ""
        for c in out.outputs:
            lps = None
            if body.logprobs is not None:
                tokens, entries = list(c.token_ids), list(c.logprobs or [])
                if body.echo:
                    tokens = p.token_ids + tokens
                    entries = list(out.prompt_logprobs or [None] * len(p.token_ids)) + entries
                lps = R.completion_logprobs(tokens, entries, top_n, st.text_of, 0)
            choices.append({"index": pi * len(out.outputs) + c.index, "text": prefix + c.text, "logprobs": lps,
                            "finish_reason": _reason(c)})
    return {"id": rid, "object": "text_completion", "created": R.now(), "model": st.cfg.served_model_name,
            "choices": choices, "usage": _usage(results)}


def _echo_text(st: _State, p: EnginePrompt) -> str:
    return p.text if p.text is not None else st.engine.tokenizer.decode(p.token_ids)


def _sse(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def _read_calls(reader: ToolReader | None, text: str, reason: str | None) -> tuple[str | None, list[ToolCall]] | None:
    """(content, calls) when the text of a completion that ended normally holds tool calls, else None
    (a completion cut for length may hold half a call: it stays text)."""
    if reader is None or reason != "stop":
        return None
    content, calls = reader.parse(text)
    return (content, calls) if calls else None


def _call_json(call: ToolCall) -> dict[str, Any]:
    return {"id": R.new_id("call"), "type": "function", "function": {"name": call.name, "arguments": call.arguments}}


async def _stream_chat(st: _State, body: ChatCompletionRequest,
                       outs: AsyncIterator[tuple[int, RequestOutput]], n: int, top_n: int, rid: str,
                       tracker: RequestTracker, include_usage: bool,
                       reader: ToolReader | None = None) -> AsyncIterator[str]:
    """With tools, text that may be the start of a call is held back until the completion ends; then
    its calls go out as `tool_calls` deltas (each whole: id, name and arguments in one) and the
    finish reason is `tool_calls`, or the held text goes out as content."""
    base = {"id": rid, "object": "chat.completion.chunk", "created": R.now(), "model": st.cfg.served_model_name}
    extra = {"usage": None} if include_usage else {}
    for i in range(n):
        yield _sse({**base, "choices": [{"index": i, "delta": {"role": "assistant", "content": ""},
                                         "logprobs": None, "finish_reason": None}], **extra})
    acc = Accumulated()
    texts, sent = [""] * n, [0] * n  # with tools: each choice's text so far, and how much of it went out
    async with _closing(outs):
        async for _, out in outs:
            acc.add(out)
            tracker.on_output(sum(len(c.token_ids) for c in out.outputs), out.queue_time)
            for c in out.outputs:  # DELTA: each holds only what is new
                if not c.text and not c.token_ids and not c.finished:
                    continue
                lps = None
                if body.logprobs and c.token_ids:
                    lps = R.chat_logprobs(c.token_ids, c.logprobs or [], top_n, st.text_of)
                reason, piece = _reason(c), c.text
                calls = None
                if reader is not None:
                    i = c.index
                    texts[i] += c.text
                    calls = _read_calls(reader, texts[i], reason) if c.finished else None
                    upto = len(texts[i]) if c.finished and calls is None else reader.hold_from(texts[i])
                    piece, sent[i] = texts[i][sent[i]:max(upto, sent[i])], max(upto, sent[i])
                if calls is not None:
                    # what is left of the text outside the calls (between or after them) goes too
                    rest, _ = reader.parse(texts[i][sent[i]:])
                    piece = piece + (rest or "") if rest and rest.strip() else piece
                    if piece:
                        yield _sse({**base, "choices": [{"index": c.index, "delta": {"content": piece},
                                                         "logprobs": None, "finish_reason": None}], **extra})
                    tool_calls = [{"index": k, **_call_json(call)} for k, call in enumerate(calls[1])]
                    yield _sse({**base, "choices": [{"index": c.index, "delta": {"tool_calls": tool_calls},
                                                     "logprobs": lps, "finish_reason": None}], **extra})
                    piece, reason, lps = "", "tool_calls", None
                delta = {"content": piece} if piece else {}
                yield _sse({**base, "choices": [{"index": c.index, "delta": delta, "logprobs": lps,
                                                 "finish_reason": reason}], **extra})
    if acc.first is not None:
        result = acc.result()
        _finish_metrics(tracker, [result])
        if include_usage:
            yield _sse({**base, "choices": [], "usage": _usage([result])})
    yield "data: [DONE]\n\n"


async def _stream_completion(st: _State, body: CompletionRequest, prompts: list[EnginePrompt],
                             outs: AsyncIterator[tuple[int, RequestOutput]], n: int, top_n: int, rid: str,
                             tracker: RequestTracker, include_usage: bool) -> AsyncIterator[str]:
    base = {"id": rid, "object": "text_completion", "created": R.now(), "model": st.cfg.served_model_name}
    extra = {"usage": None} if include_usage else {}
    echoed: set[int] = set()
    acc = [Accumulated() for _ in prompts]
    async with _closing(outs):
        async for pi, out in outs:
            acc[pi].add(out)
            tracker.on_output(sum(len(c.token_ids) for c in out.outputs), out.queue_time)
            for c in out.outputs:  # DELTA: each holds only what is new
                idx = pi * n + c.index
                text, toks = c.text, c.token_ids
                lps = None
                if body.echo and idx not in echoed:
                    echoed.add(idx)
                    p = prompts[pi]
                    text = _echo_text(st, p) + text
                    if body.logprobs is not None:
                        plps = list(acc[pi].first.prompt_logprobs or [None] * len(p.token_ids))
                        lps = R.completion_logprobs(p.token_ids + toks, plps + (c.logprobs or []),
                                                    top_n, st.text_of, 0)
                elif body.logprobs is not None and toks:
                    lps = R.completion_logprobs(toks, c.logprobs or [], top_n, st.text_of, 0)
                if not text and not toks and not c.finished:
                    continue
                yield _sse({**base, "choices": [{"index": idx, "text": text, "logprobs": lps,
                                                 "finish_reason": _reason(c)}], **extra})
    results = [a.result() for a in acc if a.finished]
    _finish_metrics(tracker, results)
    if include_usage:
        yield _sse({**base, "choices": [], "usage": _usage(results)})
    yield "data: [DONE]\n\n"


@asynccontextmanager
async def _closing(agen: Any) -> AsyncIterator[None]:
    """Close the output stream on any exit (a disconnect cancels us), which aborts the requests."""
    try:
        yield
    finally:
        await agen.aclose()
