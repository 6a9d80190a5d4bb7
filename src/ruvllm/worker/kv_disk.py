"""The disk tier's store: block files in a folder, written by a thread of their own and read back
(checked) by another, so a step only copies a block's K/V out of or into the pool.

Layout: `<kv_disk_path>/<fingerprint>/` holds one engine form's blocks (`fingerprint.json` says what
the fingerprint covers), one file per block, `<key>.kvb`:

    b"RUVKVB01" | header length (uint32 LE) | header (JSON: key, parent, token ids, shape, dtype) |
    the block's K/V (every layer's K then V, `shape`, little-endian) | BLAKE2b-256 of all before it

A file is written under a temporary name and renamed into place; a file whose length, checksum,
key, parent, token ids, shape or dtype is not what the reader expects (a torn write, a corrupted
or truncated file, another engine's block) is skipped with a warning and deleted, never loaded.
The folder's bytes stay within the budget: the least recently used files are deleted first. After
a restart the index is rebuilt from the folder (oldest modification first).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import struct
import threading
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ruvllm.core.disk_index import DiskBlock, DiskIndex, DiskLoad

if TYPE_CHECKING:
    from ruvllm.config import EngineConfig
    from ruvllm.worker.model_runner import ModelRunner
    from ruvllm.worker.worker import LoadedModel

log = logging.getLogger(__name__)

MAGIC = b"RUVKVB01"
SUFFIX = ".kvb"
_DIGEST = 32
# Bytes of spilled blocks waiting for the writer: past this a step's spills are dropped (the blocks
# are recomputed if asked again) rather than holding the step or growing without bound.
MAX_PENDING_BYTES = 256 << 20
_WEIGHT_SUFFIXES = (".gguf", ".safetensors", ".bin", ".pt", ".json")


def refusal(config: EngineConfig, loaded: LoadedModel, hybrid: bool) -> str | None:
    """Why this engine cannot have a disk tier, or None."""
    cache = config.cache
    if not cache.enable_prefix_caching:
        return "the disk KV tier holds prefix-cache blocks: it needs prefix caching (drop --no-prefix-caching)"
    if hybrid:
        return (f"{loaded.model_config.architecture} has sliding-window layers (several KV groups); the disk KV "
                "tier serves models with one KV group only")
    if cache.quantized_kv:
        return f"the disk KV tier cannot be combined with an {cache.kv_cache_dtype} KV cache (use kv_cache_dtype auto)"
    if loaded.tensor_parallel is not None:
        return "the disk KV tier cannot be combined with tensor parallelism (each rank holds a slice of every block)"
    if config.speculation.method == "draft":
        return ("the disk KV tier cannot be combined with a draft model (its own pool would not hold the loaded "
                "blocks); use --speculative ngram")
    if loaded.source is None:
        return "the disk KV tier needs a model loaded from files (its blocks are keyed by the files)"
    return None


def fingerprint(loaded: LoadedModel, config: EngineConfig) -> tuple[bytes, dict[str, Any]]:
    """What decides a block's K/V besides its tokens: the model's files (path, size, modification
    time), the weights' form (quantization settings and every tensor's name, dtype and shape), the
    compute and KV dtype, the block size and the device type. Its digest names the folder."""
    path = loaded.path
    files = sorted(p for p in (path.iterdir() if path.is_dir() else [path])
                   if p.is_file() and p.suffix in _WEIGHT_SUFFIXES)
    forms = hashlib.blake2b(digest_size=16)
    for name, t in loaded.model.state_dict().items():
        forms.update(f"{name}:{str(t.dtype)}:{tuple(t.shape)};".encode())
    what = {
        "format": 1,
        "model": str(path.resolve()),
        "files": [[p.name, p.stat().st_size, p.stat().st_mtime_ns] for p in files],
        "architecture": loaded.model_config.architecture,
        "quantization": repr(loaded.quant),
        "tensors": forms.hexdigest(),
        "dtype": str(loaded.dtype),
        "kv_cache_dtype": config.cache.kv_cache_dtype,
        "block_size": config.cache.block_size,
        "device": loaded.device.type,
    }
    return hashlib.blake2b(json.dumps(what, sort_keys=True).encode(), digest_size=16).digest(), what


@dataclass
class StagedBlocks:
    """Blocks read and verified for one request, in chain order (core/disk_index.py::Staged)."""

    blocks: list[torch.Tensor] = field(default_factory=list)

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)


@dataclass
class DiskStats:
    written: int = 0  # block files written
    dropped: int = 0  # spills not written: the writer was behind, or the tier stopped writing
    rejected: int = 0  # files skipped on read: torn, corrupted, truncated or not the expected block
    loaded: int = 0  # blocks read for a request


class KVDiskStore:
    """One engine's block files (the core's DiskTier). `block_shape`, `dtype`: one block's K/V as
    the pool holds it, (layers, 2, block size, KV heads, head dim)."""

    def __init__(self, folder: Path, budget: int, fp: bytes, described: dict[str, Any],
                 block_shape: tuple[int, ...], dtype: torch.dtype) -> None:
        self.fingerprint = fp
        self.folder = folder
        self.block_shape = block_shape
        self.dtype = dtype
        self.block_bytes = int(torch.Size(block_shape).numel()) * torch.empty(0, dtype=dtype).element_size()
        self.index = DiskIndex(budget)
        self.stats = DiskStats()
        self.writable = True
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "fingerprint.json").write_text(json.dumps(described, indent=1))
        self._rebuild()
        self._pending: deque[tuple[DiskBlock, torch.Tensor]] = deque()
        self._pending_bytes = 0
        self._cv = threading.Condition()
        self._closed = False
        self._writer = threading.Thread(target=self._write_loop, name="kv-disk-writer", daemon=True)
        self._writer.start()
        self._reader = ThreadPoolExecutor(1, thread_name_prefix="kv-disk-reader")

    @classmethod
    def open(cls, loaded: LoadedModel, config: EngineConfig, runner: ModelRunner) -> KVDiskStore | None:
        """The store of this engine's form under config.cache.kv_disk_path; None (with a warning)
        when the folder cannot be made or written: the engine serves without the tier."""
        fp, described = fingerprint(loaded, config)
        folder = Path(config.cache.kv_disk_path).expanduser() / fp.hex()  # type: ignore[arg-type]
        shape = (runner.layout.group_size, 2, runner.block_size, loaded.model_config.num_kv_heads,
                 loaded.model_config.head_dim)
        try:
            store = cls(folder, config.cache.kv_disk_budget, fp, described, shape, runner.dtype)
        except OSError as e:
            log.warning("disk KV tier off: %s cannot be used (%s)", folder, e)
            return None
        log.info("disk KV tier: %s, %d blocks (%.1f MiB) of %.1f MiB", folder, len(store.index),
                 store.index.bytes_used / 2**20, store.index.budget / 2**20)
        return store

    def _path(self, key: bytes) -> Path:
        return self.folder / (key.hex() + SUFFIX)

    def _rebuild(self) -> None:
        """The index from the folder: leftover temporary files deleted, the rest oldest first."""
        found = []
        for p in self.folder.iterdir():
            if p.name.startswith("."):
                p.unlink(missing_ok=True)  # a write that never finished
            elif p.suffix == SUFFIX and len(p.stem) == 2 * 16:
                try:
                    found.append((p.stat().st_mtime_ns, bytes.fromhex(p.stem), p.stat().st_size))
                except (OSError, ValueError):
                    continue
        for _, key, size in sorted(found):
            self._delete(self.index.add(key, size), key)

    def _delete(self, evicted: list[bytes] | None, key: bytes) -> None:
        for k in [key] if evicted is None else evicted:
            self._path(k).unlink(missing_ok=True)

    # --- writing ---------------------------------------------------------------------------------
    def spill(self, data: torch.Tensor, names: list[DiskBlock], wait: bool = False) -> None:
        """Queue blocks for the writer: `data` holds them one after another along dim 2 (a copy on
        the CPU, read from the pool before anything overwrote it). Past MAX_PENDING_BYTES the
        blocks are dropped, or with `wait` (closing) the call waits for room."""
        bs = self.block_shape[2]
        with self._cv:
            for j, name in enumerate(names):
                if not self.writable:
                    self.stats.dropped += len(names) - j
                    return
                while wait and self._pending_bytes + self.block_bytes > MAX_PENDING_BYTES and self.writable:
                    self._cv.wait()
                if self._pending_bytes + self.block_bytes > MAX_PENDING_BYTES:
                    self.stats.dropped += 1
                    continue
                self._pending.append((name, data[:, :, j * bs:(j + 1) * bs]))
                self._pending_bytes += self.block_bytes
            self._cv.notify_all()

    def _write_loop(self) -> None:
        while True:
            with self._cv:
                while not self._pending and not self._closed:
                    self._cv.wait()
                if not self._pending:
                    return
                name, block = self._pending[0]
            try:
                if self.writable and name.key not in self.index:
                    self._write(name, block)
            except OSError as e:  # disk full, folder gone or read-only: serving goes on without the tier
                log.warning("disk KV tier: writing to %s failed (%s); no more blocks are written", self.folder, e)
                self.writable = False
            with self._cv:
                self._pending.popleft()
                self._pending_bytes -= self.block_bytes
                if not self.writable:
                    self.stats.dropped += len(self._pending)
                    self._pending.clear()
                    self._pending_bytes = 0
                self._cv.notify_all()

    def _write(self, name: DiskBlock, block: torch.Tensor) -> None:
        payload = memoryview(block.contiguous().view(torch.uint8).numpy().reshape(-1))  # one copy: the slice's
        header = json.dumps({"key": name.key.hex(), "parent": name.parent.hex(), "tokens": list(name.token_ids),
                             "shape": list(block.shape), "dtype": str(block.dtype)}).encode()
        head = MAGIC + struct.pack("<I", len(header)) + header
        size = len(head) + payload.nbytes + _DIGEST
        if size > self.index.budget:  # it could never be kept
            self.stats.dropped += 1
            return
        digest = hashlib.blake2b(head, digest_size=_DIGEST)
        digest.update(payload)
        path = self._path(name.key)
        tmp = self.folder / f".{path.name}.{os.getpid()}.tmp"
        try:
            with open(tmp, "wb") as f:
                f.write(head)
                f.write(payload)
                f.write(digest.digest())
            os.replace(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        self.stats.written += 1
        self._delete(self.index.add(name.key, size), name.key)

    def flush(self) -> None:
        """Wait until every queued block is written (or dropped)."""
        with self._cv:
            while self._pending:
                self._cv.wait()

    # --- reading ---------------------------------------------------------------------------------
    def fetch(self, blocks: list[DiskBlock]) -> Future[StagedBlocks]:
        """Read and verify a chain of blocks on the reader thread; the result holds the leading
        ones that passed."""
        return self._reader.submit(self._read_chain, blocks)

    def _read_chain(self, blocks: list[DiskBlock]) -> StagedBlocks:
        staged = StagedBlocks()
        for name in blocks:
            block = self._read(name)
            if block is None:
                break
            staged.blocks.append(block)
            self.index.touch(name.key)
        self.stats.loaded += staged.num_blocks
        return staged

    def _read(self, name: DiskBlock) -> torch.Tensor | None:
        path = self._path(name.key)
        try:
            with open(path, "rb") as f:  # read into one buffer the block's tensor will share
                data = bytearray(os.fstat(f.fileno()).st_size)
                f.readinto(data)
        except OSError as e:
            log.warning("disk KV tier: %s cannot be read (%s); its tokens are computed", path.name, e)
            self.index.remove(name.key)
            return None
        problem = self._check(data, name)
        if problem is not None:
            log.warning("disk KV tier: %s skipped and deleted: %s", path.name, problem)
            self.stats.rejected += 1
            self.index.remove(name.key)
            path.unlink(missing_ok=True)
            return None
        try:
            os.utime(path)  # its age orders the index after a restart (least recently used first)
        except OSError:
            pass
        header_len = struct.unpack_from("<I", data, len(MAGIC))[0]
        start = len(MAGIC) + 4 + header_len
        raw = torch.frombuffer(data, dtype=torch.uint8, offset=start, count=self.block_bytes)
        return raw.view(self.dtype).view(self.block_shape)

    def _check(self, data: bytearray, name: DiskBlock) -> str | None:
        """Why `data` is not the block `name` (None: it is)."""
        if len(data) < len(MAGIC) + 4 + _DIGEST or not data.startswith(MAGIC):
            return "not a block file (truncated or overwritten)"
        view = memoryview(data)
        body, digest = view[:-_DIGEST], view[-_DIGEST:]
        if hashlib.blake2b(body, digest_size=_DIGEST).digest() != digest:
            return "checksum mismatch (a torn write, truncation or corruption)"
        header_len = struct.unpack_from("<I", data, len(MAGIC))[0]
        if len(MAGIC) + 4 + header_len > len(body):
            return "header past the end of the file"
        try:
            header = json.loads(bytes(body[len(MAGIC) + 4:len(MAGIC) + 4 + header_len]))
        except ValueError:
            return "unreadable header"
        if header.get("key") != name.key.hex() or header.get("parent") != name.parent.hex():
            return "another block's file"
        if tuple(header.get("tokens", ())) != name.token_ids:
            return "its token ids are not the request's"
        if tuple(header.get("shape", ())) != self.block_shape or header.get("dtype") != str(self.dtype):
            return f"shape {header.get('shape')} {header.get('dtype')}, expected {list(self.block_shape)} {self.dtype}"
        if len(body) - len(MAGIC) - 4 - header_len != self.block_bytes:
            return "wrong payload length"
        return None

    def close(self) -> None:
        """Write what is queued, then stop both threads."""
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        self._writer.join()
        self._reader.shutdown(wait=True, cancel_futures=True)


# --- the pool side: copies between the KV pool and the CPU (the only tensor work on a step) -------
def _slots(runner: ModelRunner, block_ids: list[int]) -> torch.Tensor:
    bs = runner.block_size
    ids = torch.tensor(block_ids, dtype=torch.long)
    return (ids.unsqueeze(1) * bs + torch.arange(bs)).flatten().to(runner.device)


@torch.no_grad()
def read_blocks(runner: ModelRunner, block_ids: list[int]) -> torch.Tensor:
    """The blocks' K/V of every layer, one block after another along dim 2, copied to the CPU."""
    return runner.kv_cache.index_select(2, _slots(runner, block_ids)).cpu()


@torch.no_grad()
def write_blocks(runner: ModelRunner, load: DiskLoad) -> None:
    """Copy staged blocks into the pool at the load's block ids."""
    staged: StagedBlocks = load.staged  # type: ignore[assignment]
    blocks = staged.blocks[load.first:load.first + len(load.block_ids)]
    runner.kv_cache.index_copy_(2, _slots(runner, load.block_ids), torch.cat(blocks, dim=2).to(runner.device))
