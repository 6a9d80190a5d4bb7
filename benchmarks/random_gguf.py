"""GGUF files of real architectures' shapes with random weights, for speed measurements at realistic
sizes (issue 34): the default model (135M) is mostly per-step overhead, while people run 1-8B models.

A file holds a real model's layer count, widths, head counts and FFN size (llama architecture), the
default model's tokenizer (its tokenizer.* metadata copied from the embedded SmolLM2-135M GGUF) and
random weights. The tokenizer decides the vocabulary, so every shape here has the default model's
49152 tokens: SmolLM2-1.7B's own vocabulary is that one; Llama 3's 128256 is not kept (its
tokenizer is not on this machine), which makes the Llama shapes' embedding table and LM head
smaller than the real models' (2.6x fewer rows) and leaves every other tensor as it is.

The linears ("body") are Q4_0 or Q4_K (pure: every linear the body's type, not llama-quantize's
Q4_K_M mix); the embedding table (tied) or the embedding and output tables (untied) are Q8_0, as
the default model's file has its table. llama-quantize would write a 2048- or 4096-wide output
table as Q6_K; a Q6_K table is requantized to int8 by our loader (quant/gguf_blocks.py), so each
engine would then read a table of a different size a step, while Q8_0 is read as it is by both.
Norms are ones. Weights are normal with std 0.02 (the init scale these models train from), so
activations stay finite through every layer; a fixed seed (one generator per tensor) makes the
same file every time. Tensors are made, quantized and written a slab of rows at a time, so an 8B
file needs well under 1 GB of memory. Files go to random-gguf/ in ruvllm's model cache
(~/.cache/ruvllm, or $RUVLLM_CACHE_DIR) and are reused when present.

    .venv/bin/python benchmarks/random_gguf.py smollm2-1.7b --body q4_0
    .venv/bin/python benchmarks/random_gguf.py --list

Quantizing: Q4_0 and Q8_0 with the `gguf` package's numpy quantizers; Q4_K with our own port of
llama.cpp's Q4_K quantizer (quant/llamacpp.py, the `gguf` package has none), about ten times slower
(some 15 minutes single-threaded for the 1.7B shape).
"""

from __future__ import annotations

import argparse
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType as QType
from gguf import GGML_QUANT_VERSION, GGUFValueType, LlamaFileType, quants

# Bump when the files this writes change, so that a cached file of an older layout is not reused.
LAYOUT_VERSION = 1
WEIGHT_STD = 0.02
# Rows are made and quantized in slabs of about this many weights (64 MiB of float32).
SLAB_WEIGHTS = 1 << 24
BODIES = {"q4_0": QType.Q4_0, "q4_k": QType.Q4_K}
# general.file_type as llama.cpp names a file's main type (a pure Q4_K file is closest to Q4_K_S).
FILE_TYPES = {QType.Q4_0: LlamaFileType.MOSTLY_Q4_0, QType.Q4_K: LlamaFileType.MOSTLY_Q4_K_S}
TABLE_TYPE = QType.Q8_0
ALIGNMENT = 32  # GGUF's default (general.alignment absent)
_SCALAR_FORMATS = {GGUFValueType.UINT8: "B", GGUFValueType.INT8: "b", GGUFValueType.UINT16: "H",
                   GGUFValueType.INT16: "h", GGUFValueType.UINT32: "I", GGUFValueType.INT32: "i",
                   GGUFValueType.FLOAT32: "f", GGUFValueType.BOOL: "?", GGUFValueType.UINT64: "Q",
                   GGUFValueType.INT64: "q", GGUFValueType.FLOAT64: "d"}
_SCALAR_SIZES = {kind: struct.calcsize("<" + fmt) for kind, fmt in _SCALAR_FORMATS.items()}


@dataclass(frozen=True)
class Shape:
    """A llama-architecture model's dimensions (its config.json), less the vocabulary."""
    name: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    ffn: int
    tied: bool  # one table for the embedding and the LM head (no output.weight)
    rope_theta: float
    context: int
    original_vocab: int  # the real model's, for the record: files use the default tokenizer's

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


SHAPES = {
    "smollm2-1.7b": Shape("SmolLM2-1.7B", 2048, 24, 32, 32, 8192, True, 130000.0, 8192, 49152),
    "llama-3.2-1b": Shape("Llama-3.2-1B", 2048, 16, 32, 8, 8192, True, 500000.0, 8192, 128256),
    "llama-3.1-8b": Shape("Llama-3.1-8B", 4096, 32, 32, 8, 14336, False, 500000.0, 8192, 128256),
    # For tests: every kind of tensor, widths that Q4_K's 256-weight super-blocks divide, loads in a second.
    "tiny": Shape("tiny", 256, 2, 4, 2, 512, True, 10000.0, 2048, 49152),
}


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]  # numpy order: (rows = outputs, columns = inputs); GGUF stores it reversed
    qtype: QType


def tensor_plan(shape: Shape, body: QType, vocab: int) -> list[TensorSpec]:
    """Every tensor of the file, in llama.cpp's names, in the order written."""
    h, kv = shape.hidden, shape.kv_heads * shape.head_dim
    plan = [TensorSpec("token_embd.weight", (vocab, h), TABLE_TYPE)]
    for i in range(shape.layers):
        b = f"blk.{i}."
        plan += [
            TensorSpec(b + "attn_norm.weight", (h,), QType.F32),
            TensorSpec(b + "attn_q.weight", (shape.heads * shape.head_dim, h), body),
            TensorSpec(b + "attn_k.weight", (kv, h), body),
            TensorSpec(b + "attn_v.weight", (kv, h), body),
            TensorSpec(b + "attn_output.weight", (h, shape.heads * shape.head_dim), body),
            TensorSpec(b + "ffn_norm.weight", (h,), QType.F32),
            TensorSpec(b + "ffn_gate.weight", (shape.ffn, h), body),
            TensorSpec(b + "ffn_up.weight", (shape.ffn, h), body),
            TensorSpec(b + "ffn_down.weight", (h, shape.ffn), body),
        ]
    plan.append(TensorSpec("output_norm.weight", (h,), QType.F32))
    if not shape.tied:
        plan.append(TensorSpec("output.weight", (vocab, h), TABLE_TYPE))
    return plan


def _row_bytes(qtype: QType, columns: int) -> int:
    if qtype == QType.F32:
        return 4 * columns
    block, size = quants.GGML_QUANT_SIZES[qtype]
    return columns // block * size


def _nbytes(spec: TensorSpec) -> int:
    rows = spec.shape[0] if len(spec.shape) == 2 else 1
    return rows * _row_bytes(spec.qtype, spec.shape[-1])


def _quantize(w: np.ndarray, qtype: QType) -> np.ndarray:
    if qtype == QType.Q4_K:
        import torch

        from ruvllm.quant.llamacpp import q4_k_blocks
        return q4_k_blocks(torch.from_numpy(w))
    return quants.quantize(w, qtype)


def _slabs(spec: TensorSpec, seed: int, index: int):
    """The tensor's bytes, a slab of rows at a time. One generator per tensor (seeded by the file's
    seed and the tensor's index) and a fixed slab size make the bytes the same on every run."""
    if spec.qtype == QType.F32:  # norms
        yield np.ones(spec.shape, dtype=np.float32).tobytes()
        return
    rows, cols = spec.shape
    rng = np.random.default_rng([seed, index])
    step = max(1, SLAB_WEIGHTS // cols)
    for start in range(0, rows, step):
        w = rng.standard_normal((min(step, rows - start), cols), dtype=np.float32)
        w *= WEIGHT_STD
        yield np.ascontiguousarray(_quantize(w, spec.qtype)).tobytes()


def _kv_entries(path: Path):
    """(key, the entry's raw bytes: key, type and value as the file has them) for every metadata entry
    of a GGUF file. Copying bytes keeps every type exactly; gguf's GGUFReader would build a numpy view
    per vocabulary entry (seconds for 49k tokens and 49k merges), while this walk is one pass."""
    data = path.read_bytes()
    magic, _version, _tensors, count = struct.unpack_from("<4sIQQ", data, 0)
    if magic != b"GGUF":
        raise ValueError(f"{path}: not a GGUF file")
    pos = 24

    def skip_value(kind: int, pos: int) -> int:
        if kind in _SCALAR_SIZES:
            return pos + _SCALAR_SIZES[kind]
        if kind == GGUFValueType.STRING:
            return pos + 8 + struct.unpack_from("<Q", data, pos)[0]
        if kind == GGUFValueType.ARRAY:
            item, n = struct.unpack_from("<IQ", data, pos)
            pos += 12
            if item in _SCALAR_SIZES:
                return pos + n * _SCALAR_SIZES[item]
            for _ in range(n):
                pos = skip_value(item, pos)
            return pos
        raise ValueError(f"{path}: unknown metadata value type {kind}")

    for _ in range(count):
        start = pos
        n = struct.unpack_from("<Q", data, pos)[0]
        key = data[pos + 8:pos + 8 + n].decode()
        pos = skip_value(struct.unpack_from("<I", data, pos + 8 + n)[0], pos + 8 + n + 4)
        yield key, data[start:pos]


def default_tokenizer() -> tuple[list[bytes], int]:
    """The embedded default model's tokenizer.* metadata entries (raw) and its vocabulary size."""
    from ruvllm.loader.default_model import default_model_path
    from ruvllm.loader.gguf_header import read_header

    path = default_model_path()
    entries = [raw for key, raw in _kv_entries(path) if key.startswith("tokenizer.")]
    return entries, read_header(path).fields["tokenizer.ggml.tokens"].count


def _kv(key: str, kind: GGUFValueType, value) -> bytes:
    name = key.encode()
    head = struct.pack("<Q", len(name)) + name + struct.pack("<I", kind)
    if kind == GGUFValueType.STRING:
        text = value.encode()
        return head + struct.pack("<Q", len(text)) + text
    return head + struct.pack("<" + _SCALAR_FORMATS[kind], value)


def _pad(f, alignment: int = ALIGNMENT) -> None:
    f.write(b"\0" * (-f.tell() % alignment))


def write_random_gguf(path: Path, shape: Shape, body: QType, *, seed: int = 0, progress: bool = True) -> None:
    """Write the file at `path` (the caller renames it into place): GGUF v3, header, metadata,
    tensor infos, then each tensor's data made a slab at a time (gguf's GGUFWriter takes a whole
    tensor, which for an 8B file's output table would be 800 MB of float32 before quantizing)."""
    tokenizer, vocab = default_tokenizer()
    plan = tensor_plan(shape, body, vocab)
    u32, f32 = GGUFValueType.UINT32, GGUFValueType.FLOAT32
    meta = [
        _kv("general.architecture", GGUFValueType.STRING, "llama"),
        _kv("general.type", GGUFValueType.STRING, "model"),
        _kv("general.name", GGUFValueType.STRING, f"{shape.name} shape, random weights (seed {seed}), {body.name} body"),
        _kv("llama.block_count", u32, shape.layers),
        _kv("llama.context_length", u32, shape.context),
        _kv("llama.embedding_length", u32, shape.hidden),
        _kv("llama.feed_forward_length", u32, shape.ffn),
        _kv("llama.attention.head_count", u32, shape.heads),
        _kv("llama.attention.head_count_kv", u32, shape.kv_heads),
        _kv("llama.rope.freq_base", f32, shape.rope_theta),
        _kv("llama.attention.layer_norm_rms_epsilon", f32, 1e-5),
        _kv("llama.vocab_size", u32, vocab),
        _kv("llama.rope.dimension_count", u32, shape.head_dim),
        _kv("general.file_type", u32, FILE_TYPES[body]),
        _kv("general.quantization_version", u32, GGML_QUANT_VERSION),
        *tokenizer,
    ]
    infos, offset = [], 0
    for spec in plan:
        name = spec.name.encode()
        dims = spec.shape[::-1]  # GGUF lists the fastest-moving dimension first
        infos.append(struct.pack("<Q", len(name)) + name + struct.pack(f"<I{len(dims)}QIQ", len(dims), *dims,
                                                                        spec.qtype, offset))
        offset += -(-_nbytes(spec) // ALIGNMENT) * ALIGNMENT
    total = sum(_nbytes(s) for s in plan)
    bar, task = _progress(progress, f"{shape.name} {body.name}", total)
    try:
        with open(path, "wb") as f:
            f.write(struct.pack("<4sIQQ", b"GGUF", 3, len(plan), len(meta)))
            f.writelines(meta)
            f.writelines(infos)
            for index, spec in enumerate(plan):
                _pad(f)
                written = 0
                for chunk in _slabs(spec, seed, index):
                    f.write(chunk)
                    written += len(chunk)
                    if bar is not None:
                        bar.advance(task, len(chunk))
                if written != _nbytes(spec):
                    raise AssertionError(f"{spec.name}: wrote {written} bytes, planned {_nbytes(spec)}")
            _pad(f)
    finally:
        if bar is not None:
            bar.stop()


def _progress(enabled: bool, label: str, total: int):
    if not enabled:
        return None, None
    from rich.progress import BarColumn, DownloadColumn, Progress, TimeRemainingColumn, TransferSpeedColumn

    bar = Progress("[progress.description]{task.description}", BarColumn(), DownloadColumn(),
                   TransferSpeedColumn(), TimeRemainingColumn())
    task = bar.add_task(label, total=total)
    bar.start()
    return bar, task


def cache_dir() -> Path:
    """random-gguf/ in ruvllm's model cache (--cache-dir's default: $RUVLLM_CACHE_DIR, else ~/.cache/ruvllm)."""
    from ruvllm.loader.model_cache import resolve_cache_dir
    return resolve_cache_dir() / "random-gguf"


def random_gguf(shape: str | Shape, body: str = "q4_0", *, seed: int = 0, directory: Path | None = None,
                progress: bool = True) -> Path:
    """The path of the random-weight GGUF of `shape` (a SHAPES key or a Shape) with a `body` linear
    type (q4_0 or q4_k): made once, then reused from the cache directory."""
    shape = SHAPES[shape] if isinstance(shape, str) else shape
    if body not in BODIES:
        raise ValueError(f"body {body!r}: one of {', '.join(BODIES)}")
    directory = directory or cache_dir()
    directory.mkdir(parents=True, exist_ok=True)
    tag = shape.name.lower().replace(" ", "-")
    path = directory / f"{tag}-{body}-seed{seed}-v{LAYOUT_VERSION}.gguf"
    if path.is_file():
        return path
    # Written aside and renamed, so that an interrupted run leaves no half file to be reused.
    partial = path.with_name(path.name + f".partial-{os.getpid()}")
    try:
        write_random_gguf(partial, shape, BODIES[body], seed=seed, progress=progress)
        os.replace(partial, path)
    finally:
        partial.unlink(missing_ok=True)
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("shape", nargs="?", choices=sorted(SHAPES), default="smollm2-1.7b")
    ap.add_argument("--body", choices=sorted(BODIES), default="q4_0")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dir", type=Path, default=None, help=f"where files go (default {cache_dir()})")
    ap.add_argument("--list", action="store_true", help="list the shapes and exit")
    args = ap.parse_args()
    if args.list:
        for key, s in SHAPES.items():
            print(f"{key:14} hidden {s.hidden}, {s.layers} layers, {s.heads} heads / {s.kv_heads} kv, "
                  f"ffn {s.ffn}, {'tied' if s.tied else 'untied'} table (real vocab {s.original_vocab})")
        return
    print(random_gguf(args.shape, args.body, seed=args.seed, directory=args.dir))


if __name__ == "__main__":
    main()
