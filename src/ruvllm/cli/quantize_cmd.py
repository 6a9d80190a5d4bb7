"""`ruvllm quantize`: write a model as a 4-bit Hugging Face AWQ checkpoint (GEMM), with activation-aware
scales searched on a calibration text (--method awq) or plain round-to-nearest (--method rtn); or, with
SmoothQuant scales measured on a calibration text folded in, as a dense 16/32-bit folder for
`-q w8a8` (--method smoothquant).

Heavy imports (torch, transformers) stay inside the command, so registering it costs nothing.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

import typer

from ruvllm.cli.common import CliState, clean_errors

if TYPE_CHECKING:  # torch and the loader are imported only once the command runs
    import torch

    from ruvllm.loader import ModelSource

METHODS = ("awq", "rtn", "smoothquant")
CALIBRATED = ("awq", "smoothquant")
DEFAULT_GROUP_SIZE = 128
DEFAULT_SAMPLES = 16
DEFAULT_SEQ_LEN = 512
_CACHE_DIR_HELP = "Model cache for aliases and Hub ids (default: $RUVLLM_CACHE_DIR, else ~/.cache/ruvllm)."


def _state(ctx: typer.Context) -> CliState:
    return ctx.obj if isinstance(ctx.obj, CliState) else CliState()


def _read_calibration(path: Path) -> str:
    if not path.exists():
        raise ValueError(f"{path}: calibration file not found")
    if not path.is_file():
        raise ValueError(f"{path}: calibration text must be a file")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: calibration text is not UTF-8 ({e.reason} at byte {e.start})") from None
    if not text.strip():
        raise ValueError(f"{path}: calibration file is empty")
    return text


def _check_output(out: Path, force: bool, model_path: Path) -> None:
    if out.exists() and not out.is_dir():
        raise ValueError(f"{out}: exists and is not a directory")
    if out == model_path or out in model_path.parents:
        raise ValueError(f"{out}: holds the model being quantized; choose another --output")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise ValueError(f"{out}: exists and is not empty; pass --force to replace it")


@clean_errors
def quantize_cmd(
    ctx: typer.Context,
    model: str = typer.Argument(..., help="Hugging Face folder or GGUF file (GGUF is dequantized first), "
                                          "a downloaded alias or Hub id, or `default`."),
    output: Path = typer.Option(..., "--output", "-o", metavar="DIR", help="Folder to write (new or empty)."),
    method: str = typer.Option("awq", "--method", "-m",
                               help="awq: activation-aware scales from --calibration, then round-to-nearest; "
                                    "rtn: round-to-nearest only. Both write an AWQ (GEMM) checkpoint. "
                                    "smoothquant: SmoothQuant scales from --calibration folded into a dense "
                                    "folder, for `-q w8a8`."),
    calibration: Optional[Path] = typer.Option(None, "--calibration", "-c", metavar="FILE",
                                               help="Plain text to measure activations on (awq, smoothquant)."),
    group_size: Optional[int] = typer.Option(None, "--group-size", show_default=False,
                                             help=f"awq, rtn: inputs per quantization group (32, 64, 128, 256; "
                                                  f"default {DEFAULT_GROUP_SIZE})."),
    alpha: Optional[float] = typer.Option(None, "--alpha", show_default=False,
                                          help="smoothquant: how much of the activations' range moves into the "
                                               "weights, between 0 and 1 (default: the measured best, see "
                                               "docs/quantization.md)."),
    dtype: Optional[str] = typer.Option(None, "--dtype", show_default=False,
                                        help="smoothquant: weights dtype of the folder, float32 (default), "
                                             "bfloat16 or float16."),
    samples: int = typer.Option(DEFAULT_SAMPLES, "--samples", help="Calibration blocks, spread over the text."),
    seq_len: int = typer.Option(DEFAULT_SEQ_LEN, "--seq-len", help="Tokens per calibration block."),
    clip: bool = typer.Option(True, "--clip/--no-clip",
                              help="With awq: also search how far to shrink each group's range."),
    force: bool = typer.Option(False, "--force", help="Replace --output if it exists and is not empty."),
    cache_dir: Optional[Path] = typer.Option(None, "--cache-dir", help=_CACHE_DIR_HELP),
) -> None:
    """Quantize MODEL's linear layers to int4 and write a Hugging Face AWQ checkpoint (embeddings and
    LM head stay 16-bit) that `ruvllm` and other AWQ loaders read; or (--method smoothquant) write
    MODEL with SmoothQuant scales folded in, for `--quantization w8a8`."""
    # Everything a user can get wrong is checked before the model is loaded.
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; choose one of {', '.join(METHODS)}")
    _check_method_options(method, group_size, alpha, dtype)
    text = None
    if method in CALIBRATED:
        if calibration is None:
            raise ValueError(f"--method {method} needs --calibration FILE (plain text to measure activations on)")
        text = _read_calibration(calibration.expanduser())
    elif calibration is not None:
        raise ValueError(f"--calibration applies only to --method {' and '.join(CALIBRATED)}")
    if samples < 1:
        raise ValueError(f"--samples must be at least 1, got {samples}")
    if seq_len < 2:
        raise ValueError(f"--seq-len must be at least 2, got {seq_len}")

    from ruvllm.loader import load_model_config, model_cache, load_tokenizer, resolve_model
    from ruvllm.quantize.awq_writer import check_awq_shapes

    src = resolve_model(model_cache.resolve_cli_model(model, cache_dir))
    cfg = load_model_config(src)
    if method != "smoothquant":
        group_size = DEFAULT_GROUP_SIZE if group_size is None else group_size
        check_awq_shapes(cfg, group_size)
    if text is not None and seq_len > cfg.max_position_embeddings:
        raise ValueError(f"--seq-len {seq_len} exceeds the model's context length {cfg.max_position_embeddings}")
    out = output.expanduser().absolute()
    _check_output(out, force, src.path)
    tokenizer = load_tokenizer(src)
    ids = None
    if text is not None:
        from ruvllm.quantize.awq import calibration_ids

        ids = calibration_ids(tokenizer.encode(text, add_special_tokens=False), samples, seq_len)

    if method == "smoothquant":
        assert ids is not None and calibration is not None
        _run_smoothquant(ctx, src, out, ids, tokenizer, force, calibration, alpha, dtype)
        return
    _run(ctx, src, out, method, group_size, ids, tokenizer, force, calibration, clip)


def _check_method_options(method: str, group_size: int | None, alpha: float | None, dtype: str | None) -> None:
    """Options that belong to other methods are refused rather than silently ignored."""
    if method == "smoothquant":
        if group_size is not None:
            raise ValueError("--group-size applies only to --method awq and rtn (smoothquant writes a dense folder)")
        if alpha is not None:
            from ruvllm.quantize.smoothquant import check_alpha

            check_alpha(alpha)
        if dtype is not None:
            from ruvllm.quantize.awq_writer import FLOAT_DTYPES

            if dtype not in FLOAT_DTYPES:
                raise ValueError(f"--dtype must be one of {', '.join(FLOAT_DTYPES)}, got {dtype!r}")
        return
    if alpha is not None:
        raise ValueError("--alpha applies only to --method smoothquant")
    if dtype is not None:
        raise ValueError(f"--dtype applies only to --method smoothquant (--method {method} writes fp16 and int4)")


def _progress(ctx: typer.Context) -> Any:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TextColumn("layers"),
               TimeElapsedColumn(), TimeRemainingColumn())
    return Progress(*columns, console=_state(ctx).console(stderr=True))


def _run(ctx: typer.Context, src: ModelSource, out: Path, method: str, group_size: int, ids: torch.Tensor | None,
         tokenizer: Any, force: bool, calibration: Path | None, clip: bool) -> None:
    from ruvllm.loader import model_cache
    from ruvllm.quantize.awq import awq_fold
    from ruvllm.quantize.awq_writer import load_float_model, write_awq_folder

    console = _state(ctx).console(stderr=True)
    with console.status("loading the model in float32"):
        model, cfg, names = load_float_model(src, ids.shape[1] if ids is not None else 2)
    summary = ""
    if ids is not None:
        with _progress(ctx) as progress:
            task = progress.add_task(f"AWQ scales ({ids.shape[0]} x {ids.shape[1]} tokens)", total=cfg.num_layers)
            results = awq_fold(model, ids, group_size, clip=clip, on_layer=lambda _i: progress.advance(task))
        ratios = [r.loss / r.rtn_loss for r in results if r.rtn_loss > 0] or [1.0]
        mean_alpha = sum(r.alpha for r in results) / len(results)
        clipped = f", {sum(r.clipped for r in results)} clipped" if clip else ""
        summary = (f"; calibration {ids.shape[0]} x {ids.shape[1]} tokens of {calibration}; layer output error "
                   f"vs round-to-nearest on them: {100 * (sum(ratios) / len(ratios) - 1):+.1f}% on average over "
                   f"{len(results)} groups (mean alpha {mean_alpha:.2f}{clipped})")
    with console.status(f"writing {out}"):
        write_awq_folder(src, model, names, out, group_size, replace=force, tokenizer=tokenizer)
    size = model_cache.folder_size(out) / 1e6
    typer.echo(f"wrote {out} ({method} int4, group size {group_size}, {size:.1f} MB){summary}")


def _run_smoothquant(ctx: typer.Context, src: ModelSource, out: Path, ids: torch.Tensor, tokenizer: Any,
                     force: bool, calibration: Path, alpha: float | None, dtype: str | None) -> None:
    from ruvllm.loader import model_cache
    from ruvllm.quantize.awq_writer import FLOAT_DTYPES, load_float_model, write_float_folder
    from ruvllm.quantize.smoothquant import DEFAULT_ALPHA, smooth_fold

    alpha = DEFAULT_ALPHA if alpha is None else alpha
    dtype = dtype or "float32"
    console = _state(ctx).console(stderr=True)
    with console.status("loading the model in float32"):
        model, cfg, names = load_float_model(src, ids.shape[1])
    with _progress(ctx) as progress:
        task = progress.add_task(f"SmoothQuant scales ({ids.shape[0]} x {ids.shape[1]} tokens)", total=cfg.num_layers)
        results = smooth_fold(model, ids, alpha, on_layer=lambda _i: progress.advance(task))
    with console.status(f"writing {out}"):
        write_float_folder(src, model, names, out, FLOAT_DTYPES[dtype], replace=force, tokenizer=tokenizer)
    ratios = [r.error / r.plain_error for r in results if r.plain_error > 0] or [1.0]
    size = model_cache.folder_size(out) / 1e6
    typer.echo(f"wrote {out} (smoothquant, alpha {alpha:g}, {dtype}, {size:.1f} MB; load it with -q w8a8); "
               f"calibration {ids.shape[0]} x {ids.shape[1]} tokens of {calibration}; W8A8 layer output error "
               f"vs unsmoothed on them: {100 * (sum(ratios) / len(ratios) - 1):+.1f}% on average over "
               f"{len(results)} groups")


def register(app: typer.Typer) -> None:
    app.command("quantize")(quantize_cmd)


__all__ = ["register"]
