"""`ruvllm chat`: an interactive, streaming chat in the terminal, with history and a few /commands.

Ctrl-C while a reply streams stops that reply (the request is aborted, its KV blocks freed) and
returns to the prompt; the text shown so far stays in the history, so the conversation the model
sees is the one on screen. Ctrl-C or Ctrl-D at the prompt ends the chat with exit code 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from pathlib import Path
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import typer
from rich.console import Console
from rich.markup import escape

from ruvllm.cli.common import CliState, clean_errors
from ruvllm.cli.engine_options import Flags, with_engine_flags

if TYPE_CHECKING:  # the engine imports torch: load it only once the command runs
    from ruvllm.engine.async_engine import AsyncEngine
    from ruvllm.sampling_params import SamplingParams

PROMPT = "[bold green]>>>[/] "
MODEL_HELP = ("Model path (GGUF file or Hugging Face folder), or a downloaded alias or Hub id; "
              "default: the embedded SmolLM2-135M-Instruct.")
CACHE_DIR_HELP = "Model cache for aliases and Hub ids (default: $RUVLLM_CACHE_DIR, else ~/.cache/ruvllm)."

HELP = """\
/help               this list
/clear              forget the conversation (the system prompt stays)
/system [TEXT]      set the system prompt (no TEXT: show it)
/temp [VALUE]       set the sampling temperature, 0 = greedy (no VALUE: show it)
/max-tokens [N]     set the longest reply in tokens (no N: show it)
/quit, /exit        leave (so do Ctrl-D and Ctrl-C at the prompt)
Ctrl-C while a reply streams stops it; the partial reply stays in the history."""


@dataclass
class ChatSession:
    """What the chat remembers between turns; all of it can change through /commands."""

    system: str | None
    temperature: float
    top_p: float
    max_tokens: int
    history: list[dict[str, str]] = field(default_factory=list)  # alternating user/assistant turns
    adapter: str | None = None  # the loaded LoRA adapter every reply runs with

    def messages(self, user: str) -> list[dict[str, str]]:
        head = [{"role": "system", "content": self.system}] if self.system else []
        return head + self.history + [{"role": "user", "content": user}]

    def params(self) -> SamplingParams:
        from ruvllm.sampling_params import SamplingParams
        return SamplingParams(temperature=self.temperature, top_p=self.top_p, max_tokens=self.max_tokens)


def handle_command(session: ChatSession, line: str, console: Console) -> bool:
    """Run one /command; False means leave. A bad value is one line of explanation, never an exit."""
    name, _, arg = line.partition(" ")
    arg = arg.strip()
    if name in ("/quit", "/exit"):
        return False
    if name == "/help":
        console.print(escape(HELP))
    elif name == "/clear":
        session.history.clear()
        console.print("[dim]history cleared[/]")
    elif name == "/system":
        if arg:
            session.system = arg
            console.print("[dim]system prompt set[/]")
        else:
            console.print(f"[dim]system prompt: {escape(session.system or '(the model default)')}[/]")
    elif name == "/temp":
        if not arg:
            console.print(f"[dim]temperature {session.temperature}[/]")
            return True
        try:
            value = float(arg)
        except ValueError:
            value = math.nan
        if not math.isfinite(value) or value < 0:
            console.print(f"[yellow]/temp needs a number >= 0, got {escape(arg)!r}[/]")
        else:
            session.temperature = value
            console.print(f"[dim]temperature {value}[/]")
    elif name == "/max-tokens":
        if not arg:
            console.print(f"[dim]max tokens {session.max_tokens}[/]")
        elif not arg.isdigit() or int(arg) < 1:
            console.print(f"[yellow]/max-tokens needs an integer >= 1, got {escape(arg)!r}[/]")
        else:
            session.max_tokens = int(arg)
            console.print(f"[dim]max tokens {session.max_tokens}[/]")
    else:
        console.print(f"[yellow]unknown command {escape(name)}; /help lists them[/]")
    return True


@dataclass
class _Reply:
    text: str = ""
    finish_reason: str | None = None


async def _stream(engine: AsyncEngine, ids: list[int], params: SamplingParams, reply: _Reply,
                  console: Console, lora: str | None = None) -> None:
    # `reply` is filled as we go so a Ctrl-C (which cancels this coroutine) leaves the partial text.
    # aclosing: however we leave (cancelled, or a second Ctrl-C raised right here), the stream's
    # cleanup runs now and aborts the request, instead of whenever the generator is collected.
    from ruvllm.outputs import OutputKind

    async with contextlib.aclosing(engine.generate(ids, params, output_kind=OutputKind.DELTA, lora=lora)) as outputs:
        async for out in outputs:
            for completion in out.outputs:  # DELTA: only the new text
                if completion.text:
                    console.print(completion.text, end="", markup=False, highlight=False, emoji=False,
                                  soft_wrap=True)
                reply.text += completion.text
                reply.finish_reason = completion.finish_reason


def _fit(session: ChatSession, tokenizer: Any, user: str, max_seq_len: int) -> tuple[list[int], int]:
    """Render the conversation, dropping the oldest exchanges until there is room for a reply."""
    from ruvllm.engine.prompts import render_chat
    room = min(session.max_tokens, max_seq_len // 2)
    dropped = 0
    while True:
        ids = render_chat(tokenizer, session.messages(user))
        if len(ids) + room <= max_seq_len or not session.history:
            return ids, dropped
        del session.history[:2]
        dropped += 1


def _turn(session: ChatSession, engine: AsyncEngine, runner: asyncio.Runner, user: str, console: Console) -> None:
    """One user message and its streamed reply; Ctrl-C anywhere in here only stops this turn."""
    from ruvllm.errors import RuvllmError
    reply = _Reply()
    interrupted = False
    try:
        ids, dropped = _fit(session, engine.tokenizer, user, engine.info.max_seq_len)
        if dropped:
            console.print(f"[dim](dropped the {dropped} oldest exchange(s) to fit the context)[/]")
        runner.run(_stream(engine, ids, session.params(), reply, console, session.adapter))
    except KeyboardInterrupt:
        interrupted = True  # asyncio.Runner cancelled the stream, which aborted the request
    except (RuvllmError, ValueError) as exc:
        console.print(f"\n[red]error:[/] {escape(str(exc))}")
        return
    console.print()
    if interrupted:
        console.print("[dim](stopped)[/]")
    elif reply.finish_reason == "length":
        console.print("[dim](cut at max tokens; /max-tokens raises it)[/]")
    # An interrupted reply that showed nothing leaves no trace: there is nothing to continue from.
    if reply.text or not interrupted:
        session.history += [{"role": "user", "content": user}, {"role": "assistant", "content": reply.text}]


def run_chat(session: ChatSession, engine: AsyncEngine, console: Console) -> None:
    try:
        import readline  # noqa: F401  -- gives input() line editing and history where available
    except ImportError:
        pass
    # One Runner for the whole chat: during runner.run() its SIGINT handler cancels the stream
    # (the request is aborted) and re-raises KeyboardInterrupt; outside it Ctrl-C acts as usual.
    with asyncio.Runner() as runner:
        while True:
            try:
                line = console.input(PROMPT).strip()
            except (EOFError, KeyboardInterrupt):
                console.print()
                return
            if not line:
                continue
            if line.startswith("/"):
                if not handle_command(session, line, console):
                    return
                continue
            _turn(session, engine, runner, line, console)


def chat(
    ctx: typer.Context,
    model: str | None = typer.Argument(None, metavar="MODEL", help=MODEL_HELP),
    system: str | None = typer.Option(None, "--system", help="System prompt (default: the template's own)."),
    temperature: float = typer.Option(0.7, "--temperature", "-t", help="Sampling temperature; 0 is greedy."),
    top_p: float = typer.Option(0.9, "--top-p", help="Nucleus sampling threshold in (0, 1]."),
    max_tokens: int = typer.Option(512, "--max-tokens", help="Longest reply in tokens."),
    cache_dir: str | None = typer.Option(None, "--cache-dir", help=CACHE_DIR_HELP),
    lora: str | None = typer.Option(None, "--lora", metavar="PATH",
                                    help="Reply through a PEFT LoRA adapter (a folder; enables LoRA)."),
    engine: Flags = None,  # type: ignore[assignment]  # the generated engine flags
) -> None:
    """Chat with a model in the terminal, streaming its replies (/help inside lists the commands)."""
    from ruvllm.gc_settings import defer_collection, startup_done

    defer_collection()  # until the conversation starts: gc_settings.py
    state: CliState = ctx.obj or CliState()
    console = state.console()
    session = ChatSession(system, temperature, top_p, max_tokens)
    session.params()  # validate the sampling flags before spending seconds on loading the model

    from ruvllm.engine.async_engine import AsyncEngine
    from ruvllm.device import check_device_name
    from ruvllm.loader.model_cache import resolve_cli_model

    # a bad --device fails before any model is looked for (its spelling here, as `serve` checks it;
    # whether the device exists is for the core process, which loads torch: this one runs without it)
    check_device_name(engine.get("device") or "auto")
    config = engine.to_config(resolve_cli_model(model, cache_dir), **({"enable_lora": True} if lora else {}))
    with console.status("loading model…"):
        async_engine = AsyncEngine.launch(config)
    try:
        from ruvllm.engine.prompts import has_chat_template

        if not has_chat_template(async_engine.tokenizer):
            raise ValueError(f"{Path(async_engine.info.model).name} has no chat template (a base model), so it "
                             "cannot chat; `ruvllm serve` serves its completions")
        if lora:
            session.adapter = Path(lora).name or "adapter"
            async_engine.load_lora(session.adapter, lora)
        adapter = f" + adapter {escape(session.adapter)}" if session.adapter else ""
        console.print(f"[bold]ruvllm chat[/] · {escape(Path(async_engine.info.model).name)}{adapter} · "
                      f"context {async_engine.info.max_seq_len} tokens · /help for commands, Ctrl-D to leave",
                      soft_wrap=True)
        startup_done()
        run_chat(session, async_engine, console)
    finally:
        async_engine.shutdown()


def register(app: typer.Typer) -> None:
    app.command("chat")(clean_errors(with_engine_flags()(chat)))
