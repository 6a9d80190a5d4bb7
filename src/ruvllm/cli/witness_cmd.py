"""`ruvllm witness verify | show ID`: check the witness log's hash chain, print entries."""

from __future__ import annotations

import json
import time
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
def verify_cmd(path: Optional[Path] = typer.Option(None, "--path", help=_PATH_HELP),
               key_file: Optional[Path] = typer.Option(None, "--key-file", metavar="FILE", help=(
                   "The server's --witness-key-file: check the log against its signed head, so a cut or "
                   "rewritten tail is caught (without it the tail is unchecked)."))) -> None:
    """Recompute the chain; name the first entry that breaks it, malformed or missing (exit 1)."""
    from ruvllm.witness.log import read_key, verify

    log_path = _path(path)
    v = verify(log_path, read_key(key_file) if key_file is not None else None)
    if v.broken_at is not None:
        before = f"; the {v.entries} entries before it verify" if v.entries else ""
        raise fail(f"{log_path}: the chain breaks at entry {v.broken_at}"
                   f"{f' (id {v.broken_id})' if v.broken_id is not None else ''}: {v.reason}{before}")
    if v.reason is not None:
        raise fail(f"{log_path}: {v.entries} entries, the chain verifies, but {v.reason}")
    typer.echo(f"{log_path}: {v.entries} entries, the chain verifies; the tail: {v.tail}")


@witness_app.command("show")
@clean_errors
def show_cmd(id: str = typer.Argument(..., help="A completion id (e.g. chatcmpl-...), or an entry's number."),
             path: Optional[Path] = typer.Option(None, "--path", help=_PATH_HELP)) -> None:
    """Print the entries with this id (the completion and any feedback on it) as JSON; when several
    match, list them first (on stderr)."""
    from ruvllm.witness.log import find

    entries = find(_path(path), id)
    if not entries:
        raise fail(f"no witness entry has id {id!r}")
    if len(entries) > 1:
        completions = [(e.id, e.body.get("prompt_index")) for e in entries if e.kind == "completion"]
        shared = len(set(completions)) < len(completions)
        typer.echo(f"{id!r} matches {len(entries)} entries" + (
            ", several of them different completions under one id (written by different processes, or "
            "ids that were not unique): `ruvllm witness show ENTRY` shows one" if shared else "") + ":", err=True)
        for e in entries:
            when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(e.time))
            typer.echo(f"  entry {e.seq}: {e.kind} {e.id} at {when}, tenant {e.tenant}"
                       f"{'' if e.body.get('prompt_index') is None else ', prompt ' + str(e.body['prompt_index'])}",
                       err=True)
    for e in entries:
        typer.echo(json.dumps(e.as_dict(), indent=2, ensure_ascii=False))


def register(app: typer.Typer) -> None:
    app.add_typer(witness_app, name="witness")


__all__ = ["register"]
