"""Shared by the CLI commands: the console, logging set-up, and turning errors into one clear line."""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import typer
from rich.console import Console

F = TypeVar("F", bound=Callable[..., Any])


@dataclass
class CliState:
    verbose: bool = False
    color: bool = True

    def console(self, stderr: bool = False) -> Console:
        return Console(stderr=stderr, no_color=not self.color, highlight=False)


def setup_logging(verbose: bool) -> None:
    level = "DEBUG" if verbose else os.environ.get("RUVLLM_LOG", "WARNING").upper()
    logging.basicConfig(level=getattr(logging, level, logging.WARNING),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def fail(message: str, code: int = 1) -> typer.Exit:
    """Print `error: message` on stderr and return the Exit to raise."""
    Console(stderr=True, highlight=False, soft_wrap=True).print(f"[red]error:[/red] {message}", markup=True)
    return typer.Exit(code)


def clean_errors(fn: F) -> F:
    """Expected failures (bad model, bad value, no network) become one line and exit code 1."""
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        from ruvllm.errors import RuvllmError
        try:
            return fn(*args, **kwargs)
        except (typer.Exit, typer.Abort, KeyboardInterrupt):
            raise
        except (RuvllmError, ValueError, OSError) as exc:
            raise fail(str(exc)) from None
        except Exception as exc:
            if logging.getLogger().isEnabledFor(logging.DEBUG):
                raise  # --verbose: show the traceback
            raise fail(f"internal error: {type(exc).__name__}: {exc} (run with --verbose for details)") from None
    return wrapper  # type: ignore[return-value]
