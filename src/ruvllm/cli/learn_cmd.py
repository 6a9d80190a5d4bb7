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
    from ruvllm.learning.learner import default_learned_dir
    from ruvllm.learning.policy import PolicyStore

    root = folder.expanduser() if folder is not None else default_learned_dir()
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


class _NoEngine:
    """`learn run` serves nothing: a running server loads what it promotes (the policy store's change)."""

    def load_lora(self, name: str, path: str | Path) -> None:
        pass

    def unload_lora(self, name: str) -> None:
        pass


def _tokens(tokenizer, path: Path, what: str) -> list[int]:  # noqa: ANN001
    if not path.is_file():
        raise ValueError(f"{path}: no such file ({what})")
    ids = tokenizer.encode(path.read_text(encoding="utf-8"))
    if len(ids) < 130:
        raise ValueError(f"{path}: {len(ids)} tokens; {what} needs at least 130")
    return ids


@learn_app.command("run")
@clean_errors
def run_cmd(
    scope: str = typer.Argument(..., help="A tenant, or `*` for a version served to every tenant without its own."),
    heldout: Path = typer.Option(..., "--heldout", metavar="FILE", help="Held-out text: perplexity may rise at most "
                                                                        "--max-perplexity-increase."),
    general: Optional[Path] = typer.Option(None, "--general", metavar="FILE",
                                           help="Everyday text for EWC++ and rehearsal (not the held-out text)."),
    probes: Optional[Path] = typer.Option(None, "--probes", metavar="FILE.jsonl",
                                          help='{"prompt": ..., "answer": ...} lines: answers the base model gets right '
                                               "must stay right."),
    max_perplexity_increase: float = typer.Option(0.01, "--max-perplexity-increase"),
    witness_log: Optional[str] = typer.Option(None, "--witness-log", metavar="PATH",
                                              help="Witness the promotion or refusal there (default: the server's "
                                                   "default log; `off`: nowhere)."),
    witness_key_file: Optional[Path] = typer.Option(None, "--witness-key-file", metavar="FILE",
                                                    help="The key that signs the witness log's head (as given to "
                                                         "`ruvllm serve`); needed where the log has a signed head."),
    model: str = typer.Option("default", "--model", "-m", help="The served model (folder, GGUF, alias, `default`)."),
    folder: Optional[Path] = typer.Option(None, "--dir", help=_DIR_HELP),
) -> None:
    """The deep loop: fine-tune over the pattern bank, check, and promote only if every check passes
    (at low priority; a running server serves a promoted version at its next request)."""
    import json
    import os

    from ruvllm.learning.config import LearningConfig
    from ruvllm.learning.deep import DeepConfig
    from ruvllm.learning.learner import Learner, default_learned_dir
    from ruvllm.loader import load_tokenizer, model_cache, resolve_model

    # At most nice 10, never lower again: os.nice adds, so a second run in one process (a test's, in
    # process) went to 19, and the rest of that process (a test worker) with it.
    os.setpriority(os.PRIO_PROCESS, 0, max(os.getpriority(os.PRIO_PROCESS, 0), 10))
    root = folder.expanduser() if folder is not None else default_learned_dir()
    if not (root / "bank.sqlite3").is_file():
        raise fail(f"{root}: no pattern bank there (no feedback learned yet)")
    path = model_cache.resolve_cli_model(None if model == "default" else model)
    tokenizer = load_tokenizer(resolve_model(path))
    held = _tokens(tokenizer, heldout.expanduser(), "--heldout")
    everyday = _tokens(tokenizer, general.expanduser(), "--general") if general else None
    probe_pairs = []
    if probes is not None:
        for n, line in enumerate(probes.expanduser().read_text(encoding="utf-8").splitlines(), 1):
            if line.strip():
                row = json.loads(line)
                if not isinstance(row, dict) or not row.get("prompt") or not row.get("answer"):
                    raise ValueError(f"{probes}:{n}: each line needs a \"prompt\" and an \"answer\"")
                probe_pairs.append((tokenizer.encode(row["prompt"]),
                                    tokenizer.encode(row["answer"], add_special_tokens=False)))
    from ruvllm.loader import load_model_config

    eos_ids = (tokenizer.eos_token_id,) if tokenizer.eos_token_id is not None else \
        load_model_config(resolve_model(path)).eos_token_ids
    if not eos_ids:
        raise ValueError(f"{path or 'the default model'}: names no end-of-sequence token to end corrections with")
    eos = eos_ids[0]
    from ruvllm.witness.log import WitnessLog, default_witness_path

    witness = None if witness_log == "off" else WitnessLog(Path(witness_log).expanduser() if witness_log
                                                           else default_witness_path(), key_file=witness_key_file)
    learner = Learner(path, _NoEngine(), tokenizer, eos, LearningConfig(root=str(root)), witness)
    c = learner.config.instant
    config = DeepConfig(rank=c.rank, alpha=c.alpha, targets=c.targets, max_perplexity_increase=max_perplexity_increase,
                        layers=learner.layers.cfg.num_layers - learner.layers.first)
    try:
        result = learner.deep_run(scope, held, probe_pairs, config, everyday)
    finally:
        if witness is not None:
            witness.close()
    checks = ", ".join(f"{k} {v:.4g}" for k, v in result.checks.items())
    if not result.passed:
        raise fail(f"not promoted: {'; '.join(result.failed)} ({checks})")
    typer.echo(f"promoted {scope!r} v{learner.policy.serving()[scope]} ({result.examples} examples, {result.steps} "
               f"steps, {result.seconds:.0f} s; {checks})")


def register(app: typer.Typer) -> None:
    app.add_typer(learn_app, name="learn")


__all__ = ["register"]
