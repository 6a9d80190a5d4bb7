"""The `ruvllm` command line (typer). Each command lives in its own module and registers here."""

from __future__ import annotations

import typer

from ruvllm import __version__
from ruvllm.cli.common import CliState, setup_logging

app = typer.Typer(name="ruvllm", help="Run and serve LLMs: offline, OpenAI-compatible, on CPU or GPU.",
                  no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"ruvllm {__version__}")
        raise typer.Exit()


@app.callback()
def _global(
    ctx: typer.Context,
    verbose: bool = typer.Option(False, "--verbose", "-v", help="Debug logging (RUVLLM_LOG sets the level otherwise)."),
    no_color: bool = typer.Option(False, "--no-color", help="Plain output without colours."),
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True, help="Print the version."),
) -> None:
    setup_logging(verbose)
    ctx.obj = CliState(verbose=verbose, color=not no_color)


def _register() -> None:
    # Imported here so `ruvllm --help` stays fast and each command's heavy imports stay local to it.
    from ruvllm.cli import commands
    commands.register(app)


def main() -> None:
    """Entry point: usage errors (a bad flag or value) are one line and exit 2, never a usage box."""
    import sys

    from ruvllm.cli.common import fail

    _register()
    try:
        code = app(standalone_mode=False)
    except typer.Abort:
        code = 130
    except typer.Exit as exc:
        code = exc.exit_code
    except typer.TyperException as exc:  # click's ClickException family: usage and parameter errors
        message = exc.format_message() if hasattr(exc, "format_message") else str(exc)
        code = fail(message, code=getattr(exc, "exit_code", 2)).exit_code
    sys.exit(code if isinstance(code, int) else 0)


if __name__ == "__main__":
    main()
