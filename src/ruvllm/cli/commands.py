"""Which modules contribute commands to the `ruvllm` CLI."""

from __future__ import annotations

import importlib

import typer

# Each module defines `register(app)`.
_MODULES = ["ruvllm.cli.serve_cmd", "ruvllm.cli.chat_cmd", "ruvllm.cli.models_cmd", "ruvllm.cli.bench_cmd",
            "ruvllm.cli.quantize_cmd", "ruvllm.cli.xlora_cmd",
            "ruvllm.cli.witness_cmd", "ruvllm.cli.learn_cmd", "ruvllm.cli.ray_serve_cmd"]


def register(app: typer.Typer) -> None:
    for name in _MODULES:
        importlib.import_module(name).register(app)
