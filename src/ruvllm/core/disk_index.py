"""The disk tier of the prefix cache, as the core sees it: stable block keys, the index of what is
on disk, and the calls the core makes of the worker's store (worker/kv_disk.py). No tensors and no
file contents here: the core decides which blocks to write and which to load, the worker does it.

Keys. The in-memory prefix cache chains Python's `hash()`, which differs between processes (a
string salt is hashed with the process's random seed), so the disk tier chains its own digests:
a stream's seed is a digest of the engine's fingerprint (model files and weights' form, KV dtype,
block size: worker/kv_disk.py::fingerprint) and the request's cache salt (a tenant's), and each
full block's key is a digest of its parent's key and its token ids. Two engines that would compute
different K/V for a block never share its key; a block's file also holds its parent key and token
ids, which the reader checks against the request's before it is used.
"""

from __future__ import annotations

import hashlib
import struct
import threading
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Protocol

KEY_BYTES = 16


def chain_seed(fingerprint: bytes, salt: str | None) -> bytes:
    """The key a stream's first block chains from: the engine's fingerprint and the cache salt
    (None and "" are different salts: only None is the unsalted base cache)."""
    h = hashlib.blake2b(digest_size=KEY_BYTES, person=b"ruvllm-kv-seed")
    h.update(fingerprint)
    h.update(b"\x00" if salt is None else b"\x01" + salt.encode("utf-8"))
    return h.digest()


def chain_key(parent: bytes, token_ids: Sequence[int]) -> bytes:
    """A full block's key: its parent's key and its tokens (little-endian uint32 each)."""
    h = hashlib.blake2b(parent, digest_size=KEY_BYTES, person=b"ruvllm-kv-block")
    h.update(struct.pack(f"<{len(token_ids)}I", *token_ids))
    return h.digest()


@dataclass(frozen=True, slots=True)
class DiskBlock:
    """One full block as the disk tier names it."""

    key: bytes
    parent: bytes
    token_ids: tuple[int, ...]


class Staged(Protocol):
    """Blocks a store read and checked for one request, waiting in memory to be loaded (opaque to
    the core: it passes them on to the worker in a DiskLoad)."""

    @property
    def num_blocks(self) -> int: ...  # leading blocks of the asked run that were read and verified


@dataclass(slots=True)
class DiskLoad:
    """Fill `block_ids` (this step's allocation) with staged blocks first .. first + len(block_ids)
    before the forward pass."""

    block_ids: list[int]
    staged: Staged
    first: int = 0


class DiskTier(Protocol):
    """What the core asks of the worker's store."""

    fingerprint: bytes
    index: DiskIndex

    def fetch(self, blocks: list[DiskBlock]) -> Future[Staged]:
        """Read and verify these blocks (a chain, in order) off the step's path; the result holds
        the leading ones that passed (a missing, torn or foreign file ends the run)."""
        ...


class DiskIndex:
    """The keys on disk and their files' bytes, least recently used first, within a byte budget.
    Thread-safe: the core looks keys up and touches them, the store's threads add and drop them."""

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self._sizes: OrderedDict[bytes, int] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def __contains__(self, key: bytes) -> bool:
        with self._lock:
            return key in self._sizes

    def __len__(self) -> int:
        with self._lock:
            return len(self._sizes)

    @property
    def bytes_used(self) -> int:
        with self._lock:
            return self._bytes

    def touch(self, key: bytes) -> bool:
        """Mark a key used now (it is evicted last); False when it is not on disk."""
        with self._lock:
            if key not in self._sizes:
                return False
            self._sizes.move_to_end(key)
            return True

    def add(self, key: bytes, size: int) -> list[bytes] | None:
        """Count a file written; returns the least recently used keys that must go to stay within
        the budget (the caller deletes their files), or None when the file alone exceeds it (the
        caller deletes it: it is not indexed)."""
        with self._lock:
            if size > self.budget:
                return None
            old = self._sizes.pop(key, None)
            if old is not None:
                self._bytes -= old
            self._sizes[key] = size
            self._bytes += size
            evicted = []
            while self._bytes > self.budget:
                k, s = self._sizes.popitem(last=False)
                self._bytes -= s
                evicted.append(k)
            return evicted

    def remove(self, key: bytes) -> None:
        with self._lock:
            size = self._sizes.pop(key, None)
            if size is not None:
                self._bytes -= size
