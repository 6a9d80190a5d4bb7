"""A GGUF file copied without its tokenizer's arrays, for transformers' GGUF reader to load the model from.

gguf's GGUFReader turns every item of an array of strings into numpy views, one by one, and
transformers' `from_pretrained(gguf_file=...)` reads the file twice (config, then tensors): for
Gemma 3's 262,144-token vocabulary that was 28 of the 38 s of CPU its load took, spent on metadata
the model never uses. The copy keeps every tensor (info and data) and every other key byte for byte;
tensor offsets count from the data section, so they stay valid. The one thing transformers takes
from the vocabulary, the config's vocab_size when the file has no `<arch>.vocab_size` key, is
written as that key, with the token count (Gemma 3's file has none; the default model's has). (Checked when written: the copy loads to the same config
and the same state dict as the original.)"""

from __future__ import annotations

import struct
from pathlib import Path

# GGUF value types (the spec's numbering): byte sizes of the scalars, then string and array.
_SCALAR_BYTES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_STRING, _ARRAY, _UINT32 = 8, 9, 4
_DEFAULT_ALIGNMENT = 32


class _Cursor:
    def __init__(self, data: bytes) -> None:
        self.data, self.pos = data, 0

    def take(self, fmt: str) -> int:
        value = struct.unpack_from("<" + fmt, self.data, self.pos)[0]
        self.pos += struct.calcsize(fmt)
        return value

    def skip_value(self, vtype: int) -> None:
        if vtype == _STRING:
            n = self.take("Q")
            self.pos += n
        elif vtype == _ARRAY:
            item, count = self.take("I"), self.take("Q")
            if item in _SCALAR_BYTES:
                self.pos += count * _SCALAR_BYTES[item]
            else:
                for _ in range(count):
                    self.skip_value(item)
        else:
            self.pos += _SCALAR_BYTES[vtype]


def without_vocabulary(src: Path, dst: Path) -> Path:
    """Write `src` to `dst` less its `tokenizer.ggml.*` arrays, with `<arch>.vocab_size` if it lacks one."""
    data = src.read_bytes()
    cur = _Cursor(data)
    assert cur.take("4s") == b"GGUF"
    version, n_tensors, n_kv = cur.take("I"), cur.take("Q"), cur.take("Q")
    assert version == 3, version  # little-endian version 3, as the test models are
    kept: list[bytes] = []
    keys: set[str] = set()
    arch, n_tokens, alignment = "", 0, _DEFAULT_ALIGNMENT
    for _ in range(n_kv):
        start = cur.pos
        n = cur.take("Q")
        key = data[cur.pos:cur.pos + n].decode()
        cur.pos += n
        vtype = cur.take("I")
        value_at = cur.pos
        cur.skip_value(vtype)
        if key == "general.architecture":
            arch = data[value_at + 8:cur.pos].decode()
        elif key == "general.alignment":
            alignment = struct.unpack_from("<I", data, value_at)[0]
        if vtype == _ARRAY and key.startswith("tokenizer.ggml."):
            if key == "tokenizer.ggml.tokens":
                n_tokens = struct.unpack_from("<Q", data, value_at + 4)[0]
            continue
        kept.append(data[start:cur.pos])
        keys.add(key)
    assert arch and n_tokens
    infos_at = cur.pos
    for _ in range(n_tensors):  # name, dimensions, type, offset
        n = cur.take("Q")
        cur.pos += n
        dims = cur.take("I")
        cur.pos += 8 * dims + 4 + 8
    data_at = -(-cur.pos // alignment) * alignment
    if f"{arch}.vocab_size" not in keys:
        key = f"{arch}.vocab_size".encode()
        kept.append(struct.pack("<Q", len(key)) + key + struct.pack("<II", _UINT32, n_tokens))
    head = b"GGUF" + struct.pack("<IQQ", version, n_tensors, len(kept)) + b"".join(kept) + data[infos_at:cur.pos]
    with open(dst, "wb") as f:
        f.write(head + bytes(-len(head) % alignment))
        f.write(memoryview(data)[data_at:])
    return dst
