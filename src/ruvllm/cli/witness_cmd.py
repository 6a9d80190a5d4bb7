"""`ruvllm witness verify | show ID`: check the witness log's hash chain, print entries."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer

from ruvllm.cli.common import clean_errors, fail

witness_app = typer.Typer(help="The witness log: what the server inferred, hash-chained.", no_args_is_help=True)
_PATH_HELP = "The log (default: $RUVLLM_DATA_DIR or ~/.local/share/ruvllm, witness.sqlite3)."


def _path(path: Optional[Path]) -> Path:
    from ruvllm.witness.log import default_witness_path

    return path.expanduser() if path is not None else default_witness_path()


@witness_app.command("verify")
@clean_errors
def verify_cmd(path: Optional[Path] = typer.Option(None, "--path", help=_PATH_HELP)) -> None:
    """Recompute the chain; name the first entry that breaks it (exit 1)."""
    from ruvllm.witness.log import verify

    log_path = _path(path)
    verdict = verify(log_path)
    if not verdict.ok:
        raise fail(f"{log_path}: the chain breaks at entry {verdict.broken_at} (id {verdict.broken_id}): "
                   f"{verdict.reason}; the {verdict.entries} entries before it verify")
    typer.echo(f"{log_path}: {verdict.entries} entries, the chain verifies")


@witness_app.command("show")
@clean_errors
def show_cmd(id: str = typer.Argument(..., help="A completion id (e.g. chatcmpl-...), or an entry's number."),
             path: Optional[Path] = typer.Option(None, "--path", help=_PATH_HELP)) -> None:
    """Print the entries with this id (the completion and any feedback on it) as JSON."""
    from ruvllm.witness.log import find

    entries = find(_path(path), id)
    if not entries:
        raise fail(f"no witness entry has id {id!r}")
    for e in entries:
        typer.echo(json.dumps(e.as_dict(), indent=2, ensure_ascii=False))


def register(app: typer.Typer) -> None:
    app.add_typer(witness_app, name="witness")


__all__ = ["register"]
