"""`ruvllm download MODEL --quantization int4|bf16|f16` of a safetensors model: the variant MODEL:TAG,
written from the downloaded checkpoint into the cache (a loader.hub.Converter; the cache layout
is described in loader/model_cache.py).

- int4: what `ruvllm quantize --method rtn` writes (quantize/awq_writer.py): round-to-nearest int4
  in the AWQ GEMM format, which the engine loads packed; group size as `quantize`'s default (128),
  or, when no --group-size is given and 128 does not divide the model's layers, the largest
  supported size that does (so `download smollm2 -q int4` works: its 576 inputs take 64).
- bf16 / f16: what `ruvllm export --dtype bfloat16|float16` writes (loader/export.py).

Heavy imports stay inside the functions, so importing this module costs nothing.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.console import Console

from ruvllm.loader.hub import Converter

if TYPE_CHECKING:
    from ruvllm.config import ModelConfig
    from ruvllm.loader import ModelSource

_DENSE_DTYPES = {"bf16": "bfloat16", "f16": "float16"}


def converter(console: Console | None) -> Converter:
    """A Converter that shows what it is doing on `console` (None: silently)."""

    def convert(checkpoint: Path, out: Path, tag: str, group_size: int | None) -> dict[str, Any]:
        from ruvllm.loader import resolve_model

        src = resolve_model(checkpoint)
        if tag == "int4":
            return _write_int4(src, out, group_size, console)
        if tag in _DENSE_DTYPES:
            return _write_dense(src, out, _DENSE_DTYPES[tag], console)
        raise ValueError(f"no {tag} variant can be written from a checkpoint")  # hub checks this first

    return convert


@contextlib.contextmanager
def _status(console: Console | None, text: str) -> Iterator[None]:
    if console is None:
        yield
        return
    with console.status(text):
        yield


def int4_group_size(cfg: ModelConfig, asked: int | None) -> int:
    """`asked`, else `ruvllm quantize`'s default, else the largest supported size that fits the model;
    ValueError (naming the sizes that fit) when the size taken does not fit."""
    from ruvllm.cli.quantize_cmd import DEFAULT_GROUP_SIZE
    from ruvllm.quantize.awq_writer import check_awq_shapes
    from ruvllm.quant.weights import INT4_GROUP_SIZES

    candidates = [asked] if asked is not None else [DEFAULT_GROUP_SIZE, *sorted(INT4_GROUP_SIZES, reverse=True)]
    for group in candidates:
        with contextlib.suppress(ValueError):
            check_awq_shapes(cfg, group)
            return group
    check_awq_shapes(cfg, candidates[0])  # raises, saying why and which sizes fit
    raise AssertionError("unreachable")


def _write_int4(src: ModelSource, out: Path, asked: int | None, console: Console | None) -> dict[str, Any]:
    from ruvllm.cli.quantize_cmd import DEFAULT_GROUP_SIZE
    from ruvllm.loader import load_model_config
    from ruvllm.quantize.awq_writer import load_float_model, write_awq_folder

    group = int4_group_size(load_model_config(src), asked)
    with _status(console, "loading the checkpoint in float32"):
        model, _cfg, names = load_float_model(src, 2)
    with _status(console, f"quantizing to int4 (round-to-nearest, group size {group}) and writing it"):
        write_awq_folder(src, model, names, out, group)
    fell_back = asked is None and group != DEFAULT_GROUP_SIZE
    why = f", as {DEFAULT_GROUP_SIZE} does not divide the model's layers" if fell_back else ""
    return {"group_size": group, "note": f"int4 round-to-nearest, AWQ checkpoint, group size {group}{why}"}


def _write_dense(src: ModelSource, out: Path, dtype: str, console: Console | None) -> dict[str, Any]:
    from ruvllm.loader.export import export

    with _status(console, f"writing a {dtype} copy"):
        export(src, out, dtype=dtype)
    return {"note": f"dense {dtype} copy"}


__all__ = ["converter", "int4_group_size"]
