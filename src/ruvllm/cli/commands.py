"""Which modules contribute commands to the `ruvllm` CLI."""

from __future__ import annotations

import importlib

import typer

# Each module defines `register(app)`; a module listed here that is absent is a bug, not optional.
_MODULES = ["ruvllm.cli.serve_cmd", "ruvllm.cli.chat_cmd", "ruvllm.cli.models_cmd", "ruvllm.cli.bench_cmd"]


def register(app: typer.Typer) -> None:
    for name in _MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name == name:
                continue  # not written yet
            raise
        module.register(app)
