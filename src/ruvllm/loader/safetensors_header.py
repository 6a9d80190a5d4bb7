"""Safetensors headers read and checked without touching tensor data.

A safetensors file is an 8-byte little-endian header length, a JSON header (tensor name ->
dtype, shape, data_offsets), then the data. The header is bounded before it is read, and every
entry is checked: a known dtype, a shape of whole numbers, offsets that hold exactly that many
bytes, and data that ends inside the file (a cut file fails here, naming the first tensor cut).
"""

from __future__ import annotations

import functools
import math
import json
import struct
from dataclasses import dataclass
from pathlib import Path

from ruvllm.errors import CorruptModelError, ModelLoadError

# A header is a few hundred bytes per tensor; 100 MiB would describe millions of tensors.
MAX_HEADER_BYTES = 100 * 1024**2
METADATA_KEY = "__metadata__"

# Bits per element of each safetensors dtype (the format's own list).
DTYPE_BITS = {
    "BOOL": 8, "U8": 8, "I8": 8, "F8_E5M2": 8, "F8_E4M3": 8, "F8_E8M0": 8, "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6,
    "I16": 16, "U16": 16, "F16": 16, "BF16": 16, "I32": 32, "U32": 32, "F32": 32, "C64": 64, "F64": 64,
    "I64": 64, "U64": 64,
}  # fmt: skip


@dataclass(frozen=True)
class SafetensorsEntry:
    dtype: str
    shape: tuple[int, ...]
    begin: int  # data offsets, relative to the end of the header
    end: int

    @property
    def n_elements(self) -> int:
        return math.prod(self.shape)


def read_safetensors_header(file: Path) -> dict[str, SafetensorsEntry]:
    """Tensor name -> entry, in file order (the __metadata__ entry left out). Cached on (path, mtime,
    size): the config check and the weight loader both ask."""
    try:
        stat = file.stat()
    except OSError as e:
        raise ModelLoadError(f"{file}: cannot read ({e.strerror or e})") from None
    return dict(_cached(file, stat.st_mtime_ns, stat.st_size))


@functools.lru_cache(maxsize=16)
def _cached(file: Path, _mtime_ns: int, size: int) -> tuple[tuple[str, SafetensorsEntry], ...]:
    try:
        with open(file, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise CorruptModelError(f"{file}: truncated in the safetensors header ({size} bytes; "
                                        "the header length alone takes 8)")
            (length,) = struct.unpack("<Q", head)
            if length > MAX_HEADER_BYTES:
                raise CorruptModelError(f"{file}: header length: {length} bytes is not a safetensors header "
                                        f"(at most {MAX_HEADER_BYTES})")
            if 8 + length > size:
                raise CorruptModelError(f"{file}: truncated in the safetensors header ({length} bytes declared, "
                                        f"{size - 8} present)")
            raw = f.read(length)
    except OSError as e:
        raise ModelLoadError(f"{file}: cannot read ({e.strerror or e})") from None
    try:
        header = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CorruptModelError(f"{file}: safetensors header: not valid JSON ({e})") from None
    if not isinstance(header, dict):
        raise CorruptModelError(f"{file}: safetensors header: expected a JSON object")
    data_size = size - 8 - length
    entries = []
    for name, entry in header.items():
        if name != METADATA_KEY:
            entries.append((name, _entry(file, name, entry, data_size, 8 + length)))
    return tuple(entries)


def _entry(file: Path, name: str, entry: object, data_size: int, data_start: int) -> SafetensorsEntry:
    def bad(problem: str) -> CorruptModelError:
        return CorruptModelError(f"{file}: {name}: {problem}")

    if not isinstance(entry, dict):
        raise bad("header entry is not an object")
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if dtype not in DTYPE_BITS:
        raise bad(f"unknown dtype {dtype!r}")
    if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0
                                              for d in shape):
        raise bad(f"shape {shape!r} is not a list of whole numbers")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(
            isinstance(o, int) and not isinstance(o, bool) for o in offsets) and 0 <= offsets[0] <= offsets[1]):
        raise bad(f"data_offsets {offsets!r} are not [begin, end]")
    result = SafetensorsEntry(dtype, tuple(shape), offsets[0], offsets[1])
    bits = result.n_elements * DTYPE_BITS[dtype]
    if bits != 8 * (result.end - result.begin):
        raise bad(f"shape {list(shape)} of {dtype} needs {bits // 8} bytes, data_offsets give "
                  f"{result.end - result.begin}")
    if result.end > data_size:
        raise CorruptModelError(f"{file}: truncated in tensor {name} (its data ends at byte "
                                f"{data_start + result.end}, the file has {data_start + data_size})")
    return result
