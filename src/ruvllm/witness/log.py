"""The witness log: an append-only, hash-chained record of what was inferred (and of feedback and
adapter promotions), in SQLite.

Each entry's hash is SHA-256 over the previous entry's hash and the entry's canonical JSON (its
sequence number, id, kind, time, tenant and body), so changing, removing or reordering any entry
breaks the chain from there on, and `verify` names the first entry that no longer fits.

Crash safety: the database is in WAL mode and each entry is its own transaction, written by one
thread that owns the connection. A process killed mid-write loses at most the entries not yet
committed (the one in flight, and any still queued) and never a committed one; the chain stays
whole because an entry's hash is computed from the last committed one when it is written, not
when it is queued. `synchronous=NORMAL` makes a commit durable against the process dying (the WAL
is in the OS's hands), not against the machine losing power: that would need an fsync per entry.
"""

from __future__ import annotations

import hashlib
import json
import logging
import queue
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

GENESIS = "0" * 64  # the "previous hash" of the first entry

_SCHEMA = """
CREATE TABLE IF NOT EXISTS entries (
    seq INTEGER PRIMARY KEY,
    id TEXT NOT NULL,
    kind TEXT NOT NULL,
    time REAL NOT NULL,
    tenant TEXT NOT NULL,
    body TEXT NOT NULL,
    prev_hash TEXT NOT NULL,
    hash TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS entries_id ON entries (id);
"""


@dataclass(frozen=True)
class Entry:
    seq: int
    id: str
    kind: str  # completion | feedback | promotion
    time: float
    tenant: str
    body: dict[str, Any]
    prev_hash: str
    hash: str

    def as_dict(self) -> dict[str, Any]:
        return {"seq": self.seq, "id": self.id, "kind": self.kind, "time": self.time, "tenant": self.tenant,
                "body": self.body, "prev_hash": self.prev_hash, "hash": self.hash}


def default_witness_path() -> Path:
    """$RUVLLM_DATA_DIR/witness.sqlite3, else under $XDG_DATA_HOME (~/.local/share)/ruvllm: data
    kept, not a cache anyone may clear."""
    import os

    root = os.environ.get("RUVLLM_DATA_DIR")
    if root:
        return Path(root).expanduser() / "witness.sqlite3"
    xdg = os.environ.get("XDG_DATA_HOME", "")
    base = Path(xdg) if xdg and Path(xdg).is_absolute() else Path.home() / ".local" / "share"
    return base / "ruvllm" / "witness.sqlite3"


def entry_hash(prev_hash: str, seq: int, id: str, kind: str, t: float, tenant: str, body_json: str) -> str:
    payload = json.dumps([seq, id, kind, repr(t), tenant, body_json], separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256((prev_hash + payload).encode("utf-8")).hexdigest()


def canonical(body: dict[str, Any]) -> str:
    return json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def token_hash(token_ids: list[int]) -> str:
    """SHA-256 of token ids as little-endian uint32s."""
    import numpy as np

    return hashlib.sha256(np.asarray(token_ids, dtype="<u4").tobytes()).hexdigest()


def _connect(path: Path) -> sqlite3.Connection:
    conn = sqlite3.connect(str(path), isolation_level=None, check_same_thread=False)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("PRAGMA synchronous=NORMAL")
    return conn


class WitnessLog:
    """Appends entries on a writer thread of its own (serving never waits on SQLite); `flush()`
    waits until everything queued is committed."""

    def __init__(self, path: str | Path, model_digest: Callable[[], str] | None = None) -> None:
        self.path = Path(path).expanduser()
        # A completion's model digest is computed once, on the writer thread (hashing a model's
        # bytes takes a while), and stamped on every completion entry.
        self._digest_fn = model_digest
        self._digest: str | None = None
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._conn = _connect(self.path)
        self._conn.executescript(_SCHEMA)
        self._queue: queue.Queue[tuple[str, str, str, dict[str, Any], float] | None] = queue.Queue()
        self._thread = threading.Thread(target=self._write_loop, name="witness-writer", daemon=True)
        self._thread.start()

    # --- writing ---------------------------------------------------------------------------------
    def append(self, id: str, kind: str, tenant: str, body: dict[str, Any]) -> None:
        """Queue an entry (returns at once; the writer thread hashes and commits it)."""
        self._queue.put((id, kind, tenant, body, time.time()))

    def flush(self) -> None:
        self._queue.join()

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join()
        self._conn.close()

    def _write_loop(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                self._write(*item)
            except sqlite3.Error:
                log.exception("witness log: an entry could not be written")
            finally:
                self._queue.task_done()

    def _write(self, id: str, kind: str, tenant: str, body: dict[str, Any], t: float) -> None:
        if kind == "completion" and self._digest_fn is not None:
            if self._digest is None:
                self._digest = self._digest_fn()
            body = {**body, "model_digest": self._digest}
        conn = self._conn
        conn.execute("BEGIN IMMEDIATE")  # the last entry read and the new one written in one transaction
        try:
            row = conn.execute("SELECT seq, hash FROM entries ORDER BY seq DESC LIMIT 1").fetchone()
            seq, prev = (row[0] + 1, row[1]) if row else (1, GENESIS)
            body_json = canonical(body)
            h = entry_hash(prev, seq, id, kind, t, tenant, body_json)
            conn.execute("INSERT INTO entries VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                         (seq, id, kind, t, tenant, body_json, prev, h))
            conn.execute("COMMIT")
        except BaseException:
            conn.execute("ROLLBACK")
            raise


# --- reading -------------------------------------------------------------------------------------
def _rows(path: Path) -> Iterator[tuple]:
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no witness log there")
    conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        yield from conn.execute("SELECT seq, id, kind, time, tenant, body, prev_hash, hash FROM entries ORDER BY seq")
    finally:
        conn.close()


@dataclass(frozen=True)
class Verdict:
    entries: int
    broken_at: int | None = None  # seq of the first entry that does not fit the chain
    broken_id: str | None = None
    reason: str | None = None

    @property
    def ok(self) -> bool:
        return self.broken_at is None


def verify(path: str | Path) -> Verdict:
    """Recompute the chain from the first entry; the first entry out of sequence, pointing to
    another previous hash, or whose hash is not its content's, breaks it."""
    prev, expected_seq, n = GENESIS, 1, 0
    for seq, id, kind, t, tenant, body_json, prev_hash, h in _rows(Path(path).expanduser()):
        if seq != expected_seq:
            return Verdict(n, seq, id, f"entry {expected_seq} is missing (the next is {seq})")
        if prev_hash != prev:
            return Verdict(n, seq, id, "its previous hash is not the previous entry's hash")
        if entry_hash(prev_hash, seq, id, kind, t, tenant, body_json) != h:
            return Verdict(n, seq, id, "its content does not match its hash")
        prev, expected_seq, n = h, seq + 1, n + 1
    return Verdict(n)


def find(path: str | Path, id: str) -> list[Entry]:
    """Every entry with this id (a completion, and the feedback on it), or with this sequence number."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no witness log there")
    conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        rows = conn.execute("SELECT seq, id, kind, time, tenant, body, prev_hash, hash FROM entries "
                            "WHERE id = ? OR seq = ? ORDER BY seq", (id, int(id) if id.isdigit() else -1)).fetchall()
    finally:
        conn.close()
    return [Entry(seq, eid, kind, t, tenant, json.loads(body), prev, h) for seq, eid, kind, t, tenant, body, prev, h in rows]
