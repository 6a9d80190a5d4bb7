"""GGUF headers read with bounds: metadata scalars, array lengths and tensor infos, never tensor data.

gguf's GGUFReader trusts every count in a file: a corrupt array length makes it loop, appending
empty views, for as long as the count says, and it turns each vocabulary entry into its own numpy
array (seconds for a 49k-token vocabulary). This walk checks every count and length against the
bytes left in the file before following it, keeps scalars and array lengths only (~0.1 s for the
default model), and checks that every tensor's data lies inside the file. Loading then reads each
tensor's bytes from a memory map at the offsets found here (gguf_file.py); gguf's own code is used
only to decode quantized blocks.

Every failure is one line, "<file>: <key or tensor>: <problem>", or "<file>: truncated in <where>".
"""

from __future__ import annotations

import functools
import math
import mmap
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any

from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

from ruvllm.errors import CorruptModelError, ModelLoadError

GGUF_MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)  # what gguf's reader (and llama.cpp) read
_MAX_DIMS = 4  # GGML_MAX_DIMS: ggml tensors have at most four dimensions
_MAX_NAME_BYTES = 65535  # the GGUF spec's limit on key names; tensor names are far shorter
_MAX_NESTING = 8  # arrays of arrays: real files nest at most once
_DEFAULT_ALIGNMENT = 32

_SCALARS: Mapping[GGUFValueType, str] = MappingProxyType({
    GGUFValueType.UINT8: "B", GGUFValueType.INT8: "b", GGUFValueType.UINT16: "H", GGUFValueType.INT16: "h",
    GGUFValueType.UINT32: "I", GGUFValueType.INT32: "i", GGUFValueType.FLOAT32: "f", GGUFValueType.BOOL: "?",
    GGUFValueType.UINT64: "Q", GGUFValueType.INT64: "q", GGUFValueType.FLOAT64: "d",
})  # fmt: skip
# The fewest bytes one array item of each kind can take: bounds an array's length before walking it.
_STRING_MIN_BYTES = 8  # its u64 length
_ARRAY_MIN_BYTES = 12  # u32 item type + u64 length
_KV_MIN_BYTES = 8 + 4 + 1  # key length, value type, the smallest value
_TENSOR_INFO_MIN_BYTES = 8 + 4 + 8 + 4 + 8  # name length, n_dims, one dim, type, offset
# Counts beyond these are corrupt numbers, not a file cut short: real files have ~50 metadata
# entries, a few thousand tensors, and arrays (vocabularies, merges) of at most a few million items.
_MAX_KV = 1 << 16
_MAX_TENSORS = 1 << 20
_MAX_ARRAY_ITEMS = 1 << 28


@dataclass(frozen=True)
class GGUFArray:
    """An array value: its item type and length only (vocabularies are large and not needed here)."""

    item_type: GGUFValueType
    count: int


@dataclass(frozen=True)
class GGUFTensorInfo:
    name: str
    tensor_type: GGMLQuantizationType
    dims: tuple[int, ...]  # GGUF order: the fastest-varying (input) dimension first
    offset: int  # absolute byte offset of the data in the file
    n_bytes: int

    @property
    def shape(self) -> tuple[int, ...]:
        """torch order: (out_features, in_features) for a matrix."""
        return tuple(reversed(self.dims))

    @property
    def n_elements(self) -> int:
        return math.prod(self.dims)


@dataclass(frozen=True)
class GGUFHeader:
    path: Path
    file_size: int
    version: int
    byte_order: str  # struct prefix: "<" or ">"
    fields: Mapping[str, Any]  # int, float, bool, str, or GGUFArray
    tensors: tuple[GGUFTensorInfo, ...]

    def get(self, key: str, default: Any = None) -> Any:
        return self.fields.get(key, default)


class _Walk:
    """A cursor over the mapped file that refuses to step past its end."""

    def __init__(self, data: mmap.mmap | bytes, path: Path, size: int) -> None:
        self.data, self.path, self.size = data, path, size
        self.pos = 0
        self.order = "<"
        self.where = "the GGUF header"

    def truncated(self) -> CorruptModelError:
        return CorruptModelError(f"{self.path}: truncated in {self.where} (the file ends at byte {self.size})")

    def bad(self, what: str) -> CorruptModelError:
        return CorruptModelError(f"{self.path}: {what}")

    def take(self, n: int) -> int:
        """Advance by n bytes; the offset where they start."""
        if n < 0 or self.pos + n > self.size:
            raise self.truncated()
        start = self.pos
        self.pos += n
        return start

    def unpack(self, fmt: str) -> Any:
        size = struct.calcsize(fmt)
        return struct.unpack_from(self.order + fmt, self.data, self.take(size))[0]

    def fits(self, count: int, min_bytes: int, limit: int, label: str, unit: str) -> None:
        """A count beyond `limit` that leaves no room for its items is a corrupt number: it fails
        here, naming the count. Smaller ones are followed; a file cut short then fails where the
        walk meets its end (take), naming the place."""
        if count > limit and count * min_bytes > self.size - self.pos:
            raise self.bad(f"{label}: {count} {unit} cannot fit in a file of {self.size} bytes")

    def string(self, label: str, keep: bool = True, limit: int | None = None) -> str:
        length = self.unpack("Q")
        if limit is not None and length > limit:
            raise self.bad(f"{label}: a name of {length} bytes (at most {limit})")
        start = self.take(length)
        if not keep:
            return ""
        try:
            return bytes(self.data[start:start + length]).decode("utf-8")
        except UnicodeDecodeError:
            raise self.bad(f"{label}: not valid UTF-8") from None

    def value_type(self, label: str) -> GGUFValueType:
        raw = self.unpack("I")
        try:
            return GGUFValueType(raw)
        except ValueError:
            raise self.bad(f"{label}: unknown value type {raw}") from None

    def value(self, vtype: GGUFValueType, label: str, keep: bool = True, depth: int = 0) -> Any:
        if vtype in _SCALARS:
            return self.unpack(_SCALARS[vtype])
        if vtype == GGUFValueType.STRING:
            return self.string(label, keep)
        # ARRAY: item type, length, items. Only the length is kept.
        if depth >= _MAX_NESTING:
            raise self.bad(f"{label}: arrays nested more than {_MAX_NESTING} deep")
        item_type = self.value_type(label)
        count = self.unpack("Q")
        if item_type in _SCALARS:
            self.fits(count, struct.calcsize(_SCALARS[item_type]), _MAX_ARRAY_ITEMS, label, "array items")
            self.take(count * struct.calcsize(_SCALARS[item_type]))
        elif item_type == GGUFValueType.STRING:
            self.fits(count, _STRING_MIN_BYTES, _MAX_ARRAY_ITEMS, label, "array items")
            self.skip_strings(count)
        else:
            self.fits(count, _ARRAY_MIN_BYTES, _MAX_ARRAY_ITEMS, label, "array items")
            for _ in range(count):
                self.value(item_type, label, keep=False, depth=depth + 1)
        return GGUFArray(item_type, count)

    def skip_strings(self, count: int) -> None:
        """Past `count` length-prefixed strings, as `string(keep=False)` would walk them one call each
        (a vocabulary's tokens and merges: 98k strings in the default model, 0.6 s of CPU that way,
        ~0.1 s this way; session 22), failing the same way where the file ends."""
        length = struct.Struct(self.order + "Q").unpack_from
        data, pos, size = self.data, self.pos, self.size
        for _ in range(count):
            if pos + 8 > size:
                raise self.truncated()
            pos += 8 + length(data, pos)[0]
            if pos > size:
                raise self.truncated()
        self.pos = pos


def read_header(path: Path) -> GGUFHeader:
    """The checked header of a GGUF file. Cached on (path, mtime, size): the config check, the
    weight loader and the tokenizer check each ask for it."""
    try:
        stat = path.stat()
    except OSError as e:
        raise ModelLoadError(f"{path}: cannot read ({e.strerror or e})") from None
    return _cached(path, stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=2)
def _cached(path: Path, _mtime_ns: int, size: int) -> GGUFHeader:
    try:
        with open(path, "rb") as f:
            if size == 0:
                return _parse(b"", path, 0)
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
                return _parse(data, path, min(size, len(data)))
    except OSError as e:
        raise ModelLoadError(f"{path}: cannot read ({e.strerror or e})") from None


def _parse(data: mmap.mmap | bytes, path: Path, size: int) -> GGUFHeader:
    w = _Walk(data, path, size)
    if size < 4 or bytes(data[:4]) != GGUF_MAGIC:
        raise CorruptModelError(f"{path}: not a GGUF file (magic {bytes(data[:4])!r}, expected {GGUF_MAGIC!r})")
    w.take(4)
    version = w.unpack("I")
    if version & 0xFFFF == 0:  # written on a machine of the other byte order (as gguf's reader decides)
        w.order = ">"
        version = struct.unpack_from(">I", data, 4)[0]
    if version not in SUPPORTED_VERSIONS:
        raise w.bad(f"GGUF.version: {version} is not supported (supported: {', '.join(map(str, SUPPORTED_VERSIONS))})")
    tensor_count = w.unpack("Q")
    kv_count = w.unpack("Q")
    w.fits(kv_count, _KV_MIN_BYTES, _MAX_KV, "GGUF.kv_count", "metadata entries")
    w.fits(tensor_count, _TENSOR_INFO_MIN_BYTES, _MAX_TENSORS, "GGUF.tensor_count", "tensor infos")

    fields: dict[str, Any] = {}
    previous = "the header"
    for i in range(kv_count):
        w.where = f"metadata entry {i} (after {previous})"
        key = w.string(f"metadata entry {i}", limit=_MAX_NAME_BYTES)
        if key in fields:
            raise w.bad(f"{key}: appears twice in the metadata")
        w.where = f"metadata key {key}"
        fields[key] = w.value(w.value_type(key), key)
        previous = key

    infos: list[tuple[str, tuple[int, ...], int, int]] = []
    names: set[str] = set()
    for i in range(tensor_count):
        w.where = f"tensor info {i}" + (f" (after {infos[-1][0]})" if infos else "")
        name = w.string(f"tensor info {i}", limit=_MAX_NAME_BYTES)
        w.where = f"the info of tensor {name}"
        if name in names:
            raise w.bad(f"{name}: appears twice in the tensor list")
        names.add(name)
        n_dims = w.unpack("I")
        if not 1 <= n_dims <= _MAX_DIMS:
            raise w.bad(f"{name}: {n_dims} dimensions (ggml tensors have 1 to {_MAX_DIMS})")
        dims = tuple(w.unpack("Q") for _ in range(n_dims))
        raw_type = w.unpack("I")
        infos.append((name, dims, raw_type, w.unpack("Q")))

    alignment = fields.get("general.alignment", _DEFAULT_ALIGNMENT)
    if not isinstance(alignment, int) or isinstance(alignment, bool) or alignment <= 0 \
            or alignment & (alignment - 1):
        raise w.bad(f"general.alignment: {alignment!r} is not a power of two")
    data_start = -(-w.pos // alignment) * alignment
    tensors = tuple(_tensor(w, name, dims, raw_type, offset, data_start, alignment)
                    for name, dims, raw_type, offset in infos)
    return GGUFHeader(path, size, version, w.order, MappingProxyType(fields), tensors)


def _tensor(w: _Walk, name: str, dims: tuple[int, ...], raw_type: int, offset: int, data_start: int,
            alignment: int) -> GGUFTensorInfo:
    try:
        qtype = GGMLQuantizationType(raw_type)
        block, type_size = GGML_QUANT_SIZES[qtype]
    except (ValueError, KeyError):
        raise w.bad(f"{name}: unknown ggml tensor type {raw_type}") from None
    if 0 in dims:
        raise w.bad(f"{name}: shape {list(dims)} has a zero dimension")
    if dims[0] % block:
        raise w.bad(f"{name}: rows of {dims[0]} values are not whole {qtype.name} blocks of {block}")
    info = GGUFTensorInfo(name, qtype, dims, data_start + offset, 0)
    n_bytes = info.n_elements // block * type_size
    if offset % alignment:
        raise w.bad(f"{name}: data offset {offset} is not a multiple of the alignment {alignment}")
    if n_bytes > w.size:
        raise w.bad(f"{name}: shape {list(dims)} of {qtype.name} needs {n_bytes} bytes, more than the "
                    f"whole file ({w.size} bytes)")
    end = info.offset + n_bytes
    if end > w.size:
        raise CorruptModelError(f"{w.path}: truncated in tensor {name} (its data ends at byte {end}, "
                                f"the file has {w.size})")
    return GGUFTensorInfo(name, qtype, dims, info.offset, n_bytes)
