"""`ruvllm xlora train`: train an X-LoRA classifier over LoRA adapters on labelled text (peft, CPU)
and write a checkpoint that peft and `ruvllm serve --lora NAME=DIR` load.

Heavy imports (torch, transformers, peft) stay inside the command, so registering it costs nothing.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from ruvllm.cli.common import CliState, clean_errors

xlora_app = typer.Typer(help="X-LoRA: mix LoRA adapters per token with a trained classifier.", no_args_is_help=True)


@xlora_app.command("train")
@clean_errors
def train_cmd(
    ctx: typer.Context,
    adapters: list[Path] = typer.Option(..., "--adapters", "-a", metavar="DIR",
                                        help="The LoRA adapters to mix (PEFT folders): --adapters A B C, or repeated."),
    more: Optional[list[Path]] = typer.Argument(None, metavar="[DIR]...", show_default=False,
                                                help="More adapters (what follows --adapters A)."),
    data: Path = typer.Option(..., "--data", metavar="FILE.jsonl",
                              help='JSON lines {"text": ..., "adapter": NAME_OR_INDEX}; "adapter" (the one that '
                                   "suits the text) is optional."),
    output: Path = typer.Option(..., "--output", "-o", metavar="DIR", help="Folder to write (new or empty)."),
    model: str = typer.Option("default", "--model", "-m",
                              help="The base model: folder, GGUF file, downloaded alias, or `default`."),
    depth: int = typer.Option(2, "--depth", help="Linears in the classifier."),
    size: int = typer.Option(256, "--size", help="Width of the classifier's hidden linears."),
    layerwise: bool = typer.Option(False, "--layerwise/--shared", help="One scaling per adapted module, or one for all."),
    top_k: Optional[int] = typer.Option(None, "--top-k", help="Keep each token's top k adapters (renormalized)."),
    epochs: int = typer.Option(3, "--epochs"),
    batch_size: int = typer.Option(8, "--batch-size"),
    lr: float = typer.Option(1e-3, "--lr"),
    max_tokens: int = typer.Option(128, "--max-tokens", help="Tokens of each text trained on."),
    routing_weight: float = typer.Option(1.0, "--routing-weight",
                                         help="Weight of the routing loss on labelled texts (0: the LM loss alone)."),
    eval_fraction: float = typer.Option(0.2, "--eval-fraction", help="Labelled texts held out to measure routing."),
    seed: int = typer.Option(0, "--seed"),
    force: bool = typer.Option(False, "--force", help="Replace --output if it exists and is not empty."),
    cache_dir: Optional[Path] = typer.Option(None, "--cache-dir", help="Model cache for aliases."),
) -> None:
    """Train an X-LoRA classifier over frozen LoRA adapters and a frozen base model."""
    folders = [p.expanduser() for p in [*adapters, *(more or [])]]
    if len(folders) < 2:
        raise ValueError("--adapters needs at least two LoRA adapters to mix")
    for f in folders:
        if not (f / "adapter_config.json").is_file():
            raise ValueError(f"{f}: not a PEFT adapter folder (no adapter_config.json)")
    checks = {"--depth": depth >= 1, "--size": size >= 1, "--epochs": epochs >= 1, "--batch-size": batch_size >= 1,
              "--max-tokens": max_tokens >= 2, "--lr": lr > 0, "--routing-weight": routing_weight >= 0,
              "--eval-fraction": 0 <= eval_fraction < 1, "--top-k": top_k is None or 1 <= top_k <= len(folders)}
    bad = [k for k, ok in checks.items() if not ok]
    if bad:
        raise ValueError(f"{bad[0]} is out of range (see ruvllm xlora train --help)")
    out = output.expanduser().absolute()
    if out.exists() and (not out.is_dir() or (any(out.iterdir()) and not force)):
        raise ValueError(f"{out}: exists and is not an empty directory; pass --force to replace it")

    from ruvllm.loader import load_model_config, load_tokenizer, model_cache, resolve_model
    from ruvllm.lora.peft_adapter import load_peft_adapter
    from ruvllm.lora.xlora_train import XLoraTrainConfig, read_examples, train_xlora, transformers_model

    examples = read_examples(data.expanduser(), [f.name for f in folders])
    src = resolve_model(model_cache.resolve_cli_model(None if model == "default" else model, cache_dir))
    cfg = load_model_config(src)
    for f in folders:  # each adapter checked against the model before anything trains
        load_peft_adapter(f, cfg, max_rank=1 << 16)
    config = XLoraTrainConfig(depth=depth, size=size, layerwise_scalings=layerwise, top_k=top_k, epochs=epochs,
                              batch_size=batch_size, lr=lr, max_tokens=max_tokens, routing_weight=routing_weight,
                              eval_fraction=eval_fraction, seed=seed)
    state = ctx.obj if isinstance(ctx.obj, CliState) else CliState()
    console = state.console(stderr=True)
    with console.status("loading the model in float32"):
        base = transformers_model(src)
        tokenizer = load_tokenizer(src)
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TextColumn("loss {task.fields[loss]}"),
               TimeElapsedColumn(), TimeRemainingColumn())
    with Progress(*columns, console=console) as progress:
        task = progress.add_task("training the X-LoRA classifier", total=None, loss="-")

        def step(done: int, total: int, loss: float) -> None:
            progress.update(task, completed=done, total=total, loss=f"{loss:.3f}")

        result = train_xlora(base, tokenizer, folders, examples, out, config, on_step=step, replace=force)
    routing = "" if result.routing_accuracy is None else (
        f"; routing on {result.held_out} held-out texts: {100 * result.routing_accuracy:.1f}% to their adapter")
    typer.echo(f"wrote {out} (X-LoRA over {len(folders)} adapters, {result.steps} steps, loss "
               f"{result.first_loss:.3f} -> {result.last_loss:.3f}{routing})")


def register(app: typer.Typer) -> None:
    app.add_typer(xlora_app, name="xlora")


__all__ = ["register"]
