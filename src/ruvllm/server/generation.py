"""The HTTP side of the generation service (engine/generation.py), shared by every API dialect's
router: the server's state, admission (429), context checks, and one API call's run (its engine
requests followed, measured, collected or streamed as server-sent events)."""

from __future__ import annotations

import asyncio
import secrets
import logging
from collections.abc import AsyncIterator, Callable, Coroutine
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any, TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from ruvllm.engine.async_engine import AsyncEngine
from ruvllm.engine.prompts import render_chat
from ruvllm.errors import RuvllmError
from ruvllm.engine.generation import Following, GenerationService
from ruvllm.outputs import RequestOutput
from ruvllm.request import Priority
from ruvllm.sampling_params import SamplingParams
from ruvllm.server.config import ServerConfig
from ruvllm.server.errors import APIError, Dialect, api_error, dialect_for
from ruvllm.server.metrics import RequestTracker, ServerMetrics
from ruvllm.server.model_pool import HOLDS_KEY, ModelPool, keep_alive_seconds
from ruvllm.server.responses import TokenText
from ruvllm.server.tenants import tenant_of
from ruvllm.tenants import may_use
from ruvllm.tools.format import ToolError, ToolUse, prepare_messages
from ruvllm.tools.parsers import ToolReader
from ruvllm.tools.reasoning import ReasoningTags

log = logging.getLogger(__name__)


RETRY_AFTER_S = 1  # capacity frees as fast as sequences finish: seconds, not minutes
T = TypeVar("T")


@dataclass
class Admission:
    """Counts the sequences in flight; refuses new ones past running cap + queue length (HTTP 429)."""

    limit: int
    in_flight: int = 0

    def acquire(self, n: int, param: str | None) -> None:
        """`param`: the field that asked for the `n` sequences (n, or prompt for a list of prompts)."""
        if n > self.limit:  # could never be admitted, even on an idle server: not worth a retry
            raise APIError(400, f"this request asks for {n} sequences, but this server admits at most "
                                f"{self.limit} at once; send fewer prompts or a smaller n", param,
                           "too_many_sequences")
        if self.in_flight + n > self.limit:
            raise APIError(429, f"the server is at capacity ({self.in_flight} sequences in flight, "
                                f"limit {self.limit}); retry later", None, "queue_full",
                           headers={"Retry-After": str(RETRY_AFTER_S)})
        self.in_flight += n

    def release(self, n: int) -> None:
        self.in_flight -= n

    @staticmethod
    def next_id(prefix: str) -> str:
        """`prefix` (with its separator: `chatcmpl-`, `msg_`, `resp_`: each dialect's own shape) and 128
        random bits: unique across restarts and processes and unguessable. It is the id the client sees
        and the one feedback, the learned store and the witness log name the completion by."""
        return f"{prefix}{secrets.token_hex(16)}"


@dataclass
class EnginePrompt:
    token_ids: list[int]
    text: str | None  # as the user sent it, when it was text


def check_context(prompt: EnginePrompt, max_tokens: int | None, max_len: int) -> int:
    """The completion budget of a prompt; 400 (stating both numbers) when it cannot fit."""
    n = len(prompt.token_ids)
    if max_tokens is None:
        if n >= max_len:
            raise APIError(400, f"This model's maximum context length is {max_len} tokens. However, your "
                                f"prompt has {n} tokens, leaving no room for a completion.", "messages",
                           "context_length_exceeded")
        return max_len - n
    if n + max_tokens > max_len:
        raise APIError(400, f"This model's maximum context length is {max_len} tokens. However, you "
                            f"requested {n + max_tokens} tokens ({n} in the prompt, {max_tokens} for the "
                            f"completion). Please reduce the prompt or max_tokens.", "max_tokens",
                       "context_length_exceeded")
    return max_tokens


@dataclass
class ServerState:
    """What every router reads (`state(request)`)."""

    engine: AsyncEngine
    cfg: ServerConfig
    metrics: ServerMetrics
    admission: Admission
    service: GenerationService
    text_of: TokenText
    created: int
    feedback: Any = None  # server/feedback.py's Feedback, with --learn
    # Read off the chat template once: whether it renders tools itself, and how calls are read back
    native_tools: bool = False
    tool_parser: ToolReader | None = None
    # A thinking model's reasoning tags (None: it does not think) and the end tag's tokens (server/reasoning.py)
    reasoning: ReasoningTags | None = None
    reasoning_end_ids: tuple[int, ...] = ()

    @property
    def max_len(self) -> int:
        return self.engine.info.max_seq_len

    async def chat_prompt(self, messages: list[dict[str, Any]], tools: ToolUse | None = None, param: str = "messages",
                          variables: dict[str, Any] | None = None, add_generation_prompt: bool = True) -> list[int]:
        """A conversation (OpenAI's chat message dicts, whatever the dialect sent) rendered by the chat
        template and tokenized, with the tools shown as the template or tools/format.py shows them;
        a template's own refusal (roles that must alternate...) is the request's fault: a 400 naming
        `param`. Off the event loop: a long conversation takes long to render and tokenize."""
        native = self.native_tools
        try:
            msgs = prepare_messages(messages, tools, native)
            use_tools = tools.openai_tools() if tools is not None and tools.active and native else None
            ids = await asyncio.to_thread(render_chat, self.engine.tokenizer, msgs, self.cfg.chat_template,
                                          add_generation_prompt, use_tools, variables)
        except (ToolError, APIError, RuvllmError):  # typed: errors.py's table says what each means
            raise
        except Exception as exc:
            raise APIError(400, f"cannot apply the chat template: {exc}", param) from None
        return list(ids)

    def check_model(self, model: str | None, tenant: str) -> str | None:
        """The LoRA adapter a request's `model` names (None: the base model); 404 for an unknown name and
        for another tenant's learned adapter alike (nobody learns that it exists)."""
        if model is None or model == self.cfg.served_model_name:
            return None
        loras = [a for a in self.engine.loras if may_use(tenant, a)]
        if model in loras:
            return model
        served = ", ".join(f"`{m}`" for m in [self.cfg.served_model_name, *loras])
        raise APIError(404, f"The model `{model}` does not exist. This server serves {served}.", "model",
                       "model_not_found")

    async def serve(self, request: Request, prompts: list[EnginePrompt], params: list[SamplingParams],
                    kind: str, adapter: str | None, chunks: Callable[[Run], AsyncIterator[str]],
                    answer: Callable[[Run, list[RequestOutput]], dict[str, Any]], *, user: str | None,
                    stream: bool, priority: str | None = None) -> Response:
        """One API call, whatever its dialect: its sequences (prompts x n) admitted, handed to the
        service, and answered as `chunks` (the dialect's stream frames) when `stream`, else as
        `answer`'s body. `user`: the tenant the body names (keys aside); `kind` is its id's prefix, with
        its separator."""
        run = await self.begin(request.url.path, tenant_of(request, user), prompts, params, kind, adapter, priority)
        seqs = run.seqs
        if stream:
            return _Stream(chunks(run), release=lambda: self.admission.release(seqs),
                           dialect=dialect_for(request.url.path))
        try:
            final = await run.collect(request)
        finally:
            self.admission.release(seqs)
        if final is None:
            return Response(status_code=499)  # client closed the request; nobody reads this
        return JSONResponse(answer(run, final))

    async def begin(self, endpoint: str, tenant: str, prompts: list[EnginePrompt], params: list[SamplingParams],
                    kind: str, adapter: str | None, priority: str | None = None) -> Run:
        """One API call's sequences (prompts x n) admitted and handed to the service, not started until
        its outputs are first read; the caller gives the admission back (`admission.release(run.seqs)`)
        however the call ends. `endpoint` labels its metrics (HTTP: the path; gRPC: the method)."""
        seqs = params[0].n * len(prompts)
        self.admission.acquire(seqs, "prompt" if len(prompts) > 1 else "n")
        tracker = RequestTracker(self.metrics, endpoint)
        try:
            following = await self.service.start(
                self.engine, self.admission.next_id(kind), tenant, adapter, [p.token_ids for p in prompts], params,
                Priority[(priority or "normal").upper()], tracker.on_output)
        except BaseException:
            self.admission.release(seqs)
            raise
        return Run(following, tracker, adapter or self.cfg.served_model_name)

    async def admitted(self, request: Request, n: int, param: str,
                       work: Callable[[int], Coroutine[Any, Any, T]]) -> T | None:
        """`work(slots)` for a call of `n` pooled inputs (embeddings, scored pairs), holding `slots`
        admission slots: at most the engine's running cap of its inputs in the engine at once, so a
        large call waits for slots of its own rather than being refused. None when the client left first."""
        slots = min(n, self.engine.info.max_num_seqs)
        self.admission.acquire(slots, param)
        try:
            return await unless_client_leaves(request, work(slots))
        finally:
            self.admission.release(slots)


async def state(request: Request) -> ServerState:
    """The state of the model the request is for. One model (`ruvllm serve MODEL`): that model's, and
    nothing of the request is read. Many (server/model_pool.py): the model its body's `model` names (an
    adapter's name: its parent's; none: the first model), loaded first when it is not, and held until
    the response has ended (ModelHolds releases it). The body was parsed by FastAPI before its
    dependencies run; `request.json()` hands back that parse, so routing costs no second one."""
    pool: ModelPool = request.app.state.models
    single = pool.single
    if single is not None:
        return single
    body = await _json_body(request)
    model = body.get("model")
    if model is None and request.url.path == "/api/show":
        model = body.get("name")  # Ollama's older spelling
    if model is None and request.url.path == "/v1/unload_lora_adapter":
        model = body.get("lora_name")  # the adapter's own model
    if isinstance(model, str) and request.url.path.startswith("/api/"):
        from ruvllm.server.ollama_protocol import served_name  # (it imports this module)

        model = served_name(model)  # Ollama's `:latest` tag
    name = pool.resolve(model if isinstance(model, str) else None)
    st = await pool.acquire(name, keep_alive_seconds(body.get("keep_alive")))
    getattr(request.state, HOLDS_KEY).append(name)
    return st


async def _json_body(request: Request) -> dict[str, Any]:
    if request.method in ("GET", "HEAD", "DELETE"):
        return {}
    try:
        body = await request.json()
    except ValueError:  # no body, or not JSON: the route's own parse answers that
        return {}
    return body if isinstance(body, dict) else {}


@dataclass
class Run:
    """One API call's engine requests (`following`: iterate within `aclosing(run.following)`, so that
    any exit aborts them), measured as they come and, by `finish`, at the end."""

    following: Following
    tracker: RequestTracker
    model: str  # echoed in every body and chunk: what the client asked for (an adapter's name), as vLLM does

    @property
    def id(self) -> str:
        return self.following.call.request_id

    @property
    def seqs(self) -> int:
        """The admission slots it holds: its prompts times n."""
        call = self.following.call
        return len(call.prompts) * call.params[0].n

    def finish(self) -> list[RequestOutput]:
        self.tracker.on_finish(self.following.results)
        return self.following.results

    async def collect(self, request: Request) -> list[RequestOutput] | None:
        """Wait for the final outputs; None if the client went away first (its requests are aborted)."""

        async def consume() -> list[RequestOutput]:
            async with aclosing(self.following):
                async for _ in self.following:
                    pass
            return self.finish()

        return await unless_client_leaves(request, consume())


async def unless_client_leaves(request: Request, work: Coroutine[Any, Any, T]) -> T | None:
    """What `work` returns (or raises), or None when the client left first: then, as when this wait is
    cancelled, `work` is cancelled, which raises inside its engine requests' streams and aborts them.
    `work` never returns None itself. A client that left is seen by asking, every quarter second."""
    task = asyncio.create_task(work)
    try:
        while not task.done():
            await asyncio.wait({task}, timeout=0.25)
            if not task.done() and await request.is_disconnected():
                return None
        return task.result()  # raises what the engine raised
    finally:
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)


class _Stream(StreamingResponse):
    """A stream (server-sent events, or Ollama's NDJSON) that returns its admission slots however it
    ends: a client that leaves before the body is first read never starts the body's generator, so its
    `finally` cannot be relied on."""

    def __init__(self, chunks: AsyncIterator[str], release: Callable[[], None], dialect: Dialect) -> None:
        super().__init__(self._with_error_event(chunks, dialect), media_type=dialect.stream_media_type)
        self._release = release

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._release()
            await self.body_iterator.aclose()  # type: ignore[attr-defined]  # aborts the engine requests

    @staticmethod
    async def _with_error_event(chunks: AsyncIterator[str], dialect: Dialect) -> AsyncIterator[str]:
        """An error mid-stream becomes the dialect's last frames (OpenAI's: an error event and [DONE]);
        the status line is long gone, and a stream never just stops."""
        try:
            async for c in chunks:
                yield c
        except Exception as exc:
            err = api_error(exc)
            if err.status == 500 and err.code is None:  # not raised on purpose
                log.exception("stream failed")
            for frame in dialect.stream_end(dialect.body(err.status, err.message, err.param, err.code)):
                yield frame
        finally:
            await chunks.aclose()  # type: ignore[attr-defined]
