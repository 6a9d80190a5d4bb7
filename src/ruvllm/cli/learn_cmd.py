"""`ruvllm learn status | versions TENANT | rollback TENANT [VERSION] | reset TENANT`: the policy
store of learned adapters (docs/learning.md). A running server follows a rollback or reset at its
next request."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Optional

import typer

from ruvllm.cli.common import CliState, clean_errors, fail

learn_app = typer.Typer(help="Learned adapters: which version serves which tenant.", no_args_is_help=True)
_DIR_HELP = "The learned adapters' folder (ruvllm serve --learned-dir; default: beside the witness log)."


def _store(folder: Optional[Path]):  # noqa: ANN202
    from ruvllm.learning.learner import _default_root
    from ruvllm.learning.policy import PolicyStore

    root = folder.expanduser() if folder is not None else _default_root()
    path = root / "policy.sqlite3"
    if not path.is_file():
        raise fail(f"{path}: no policy store there (nothing learned yet)")
    return PolicyStore(path)


def _when(t: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t))


@learn_app.command("status")
@clean_errors
def status_cmd(ctx: typer.Context, folder: Optional[Path] = typer.Option(None, "--dir", help=_DIR_HELP)) -> None:
    """Each tenant: the version serving it, how many it has, and the last change."""
    from rich.table import Table

    store = _store(folder)
    serving = store.serving()
    table = Table("tenant", "serving", "versions", "last change")
    for tenant in store.tenants():
        last = store.history(tenant)[-1]
        table.add_row(tenant, f"v{serving[tenant]}" if tenant in serving else "base model",
                      str(len(store.versions(tenant))), f"{last[2]} {'' if last[3] is None else f'v{last[3]} '}"
                                                        f"at {_when(last[0])}")
    state = ctx.obj if isinstance(ctx.obj, CliState) else CliState()
    state.console().print(table)


@learn_app.command("versions")
@clean_errors
def versions_cmd(tenant: str = typer.Argument(...), folder: Optional[Path] = typer.Option(None, "--dir", help=_DIR_HELP)
                 ) -> None:
    """A tenant's versions, oldest first (* serves it), and its history."""
    store = _store(folder)
    versions = store.versions(tenant)
    if not versions:
        raise fail(f"tenant {tenant!r} has no learned versions")
    serving = store.serving().get(tenant)
    for v in versions:
        checks = ", ".join(f"{k} {val:.4g}" if isinstance(val, float) else f"{k} {val}" for k, val in v.checks.items())
        typer.echo(f"{'*' if v.version == serving else ' '} v{v.version}  {_when(v.created)}  {v.source}  {checks}  {v.path}")


@learn_app.command("rollback")
@clean_errors
def rollback_cmd(tenant: str = typer.Argument(...), version: Optional[int] = typer.Argument(None),
                 folder: Optional[Path] = typer.Option(None, "--dir", help=_DIR_HELP)) -> None:
    """Serve an earlier version to TENANT (default: the one before the serving one)."""
    target = _store(folder).rollback(tenant, version)
    typer.echo(f"tenant {tenant!r} is served v{target.version}")


@learn_app.command("reset")
@clean_errors
def reset_cmd(tenant: str = typer.Argument(...), folder: Optional[Path] = typer.Option(None, "--dir", help=_DIR_HELP)
              ) -> None:
    """Serve TENANT the base model again (its versions stay listed; feedback starts afresh)."""
    _store(folder).reset(tenant)
    typer.echo(f"tenant {tenant!r} is served the base model")


def register(app: typer.Typer) -> None:
    app.add_typer(learn_app, name="learn")


__all__ = ["register"]
