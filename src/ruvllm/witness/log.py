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

The signed head (with a key): after each commit that leaves nothing queued, the writer replaces
LOG.head (a temp file renamed over it) with the entry count and the last entry's hash, HMAC-signed,
so a log cut short or rewritten no longer matches it. Commit first, head second: a process killed
between the two leaves rows the head does not cover yet (verify reports them), never a head ahead
of the log.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
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


class WitnessError(ValueError):
    """A witness log that does not match its signed head, or a head or key that cannot be used."""


def head_path(log_path: Path) -> Path:
    return log_path.with_name(log_path.name + ".head")


def read_key(path: str | Path) -> bytes:
    key = Path(path).expanduser().read_bytes().strip()
    if not key:
        raise WitnessError(f"{path}: the key file is empty")
    return key


def _mac(key: bytes, entries: int, h: str, t: float) -> str:
    return hmac.new(key, json.dumps([entries, h, repr(t)]).encode(), hashlib.sha256).hexdigest()


def write_head(log_path: Path, key: bytes, entries: int, h: str) -> None:
    t, head = time.time(), head_path(log_path)
    tmp = head.with_name(f"{head.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps({"entries": entries, "hash": h, "time": t, "mac": _mac(key, entries, h, t)}))
    os.replace(tmp, head)  # atomic: a reader sees the old head or the new one


def read_head(log_path: Path, key: bytes) -> tuple[int, str, float]:
    """The signed head: (entries, the last one's hash, when it was written); WitnessError when it
    is missing or its MAC does not verify."""
    head = head_path(log_path)
    try:
        d = json.loads(head.read_bytes())
        fields = (d["entries"], d["hash"], d["time"])
        ok = hmac.compare_digest(_mac(key, *fields), d["mac"])
    except FileNotFoundError:
        raise WitnessError(f"{head}: no signed head there (deleted, or the log was never written with a key)") from None
    except (ValueError, KeyError, TypeError):
        ok = False
    if not ok:
        raise WitnessError(f"{head}: the signed head does not verify (forged or damaged, or signed with another key)")
    return fields


def _when(t: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t))


def _head_mismatch(head: tuple[int, str, float], entries: int, hash_at_head: str | None) -> str | None:
    """What is wrong with a log of `entries` entries whose entry number head[0] has hash_at_head."""
    count, h, t = head
    when = _when(t)
    if entries < count:
        missing = f"entry {count} is" if entries + 1 == count else f"entries {entries + 1} to {count} are"
        return f"{missing} missing: the signed head of {when} records {count} entries"
    if (hash_at_head or GENESIS) != h:
        return (f"its hash is not the one the signed head of {when} records: the log was rewritten at or before "
                f"this entry (with its hashes recomputed)")
    return None


def _connect(path: Path) -> sqlite3.Connection:
    conn = sqlite3.connect(str(path), isolation_level=None, check_same_thread=False)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("PRAGMA synchronous=NORMAL")
    return conn


class WitnessLog:
    """Appends entries on a writer thread of its own (serving never waits on SQLite); `flush()`
    waits until everything queued is committed."""

    def __init__(self, path: str | Path, model_digest: Callable[[], str] | None = None,
                 key_file: str | Path | None = None) -> None:
        self.path = Path(path).expanduser()
        self._key = read_key(key_file) if key_file else None  # signs the head after each commit
        # A completion's model digest is computed once, on the writer thread (hashing a model's
        # bytes takes a while), and stamped on every completion entry.
        self._digest_fn = model_digest
        self._digest: str | None = None
        if self._key is None and head_path(self.path).exists():
            # entries written without the key would lie past what the head vouches for, unsigned
            raise WitnessError(f"{self.path} has a signed head ({head_path(self.path)}): give its key "
                               f"(--witness-key-file) so that new entries are signed too")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._conn = _connect(self.path)
        self._conn.executescript(_SCHEMA)
        try:
            if self._key is not None:
                self._check_head()
        except BaseException:
            self._conn.close()
            raise
        self._queue: queue.Queue[tuple[str, str, str, dict[str, Any], float] | None] = queue.Queue()
        self._thread = threading.Thread(target=self._write_loop, name="witness-writer", daemon=True)
        self._thread.start()

    def _check_head(self) -> None:
        """Refuse a log that no longer matches its signed head: writing a new head would hide the cut."""
        exists = head_path(self.path).exists()
        head = read_head(self.path, self._key) if exists else (0, GENESIS, 0.0)  # type: ignore[arg-type]
        n, h = self._conn.execute("SELECT max(seq), (SELECT hash FROM entries WHERE seq = ?) FROM entries",
                                  (head[0],)).fetchone()
        if not exists and n:  # the first commit signs a head over what is there, which nothing vouched for
            log.warning("%s: no signed head yet; the first one will cover the %d entries already there", self.path, n)
        problem = _head_mismatch(head, n or 0, h)
        if problem:
            raise WitnessError(f"{self.path} does not match its signed head ({problem}); `ruvllm witness verify "
                               f"--key-file` says more, and moving {head_path(self.path)} away starts a new head")

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
        head = None  # (count, hash) of the last commit, until the signed head says it
        while True:
            item = self._queue.get()
            try:
                head = self._write(*item) if item is not None else head
                # in a burst the head is written once, at its end (a head write costs ~1 ms, an entry ~0.2)
                if head is not None and self._key is not None and (item is None or self._queue.empty()):
                    write_head(self.path, self._key, *head)
                    head = None
            except (sqlite3.Error, OSError):
                log.exception("witness log: an entry or its signed head could not be written")
            finally:
                self._queue.task_done()
            if item is None:
                return

    def _write(self, id: str, kind: str, tenant: str, body: dict[str, Any], t: float) -> tuple[int, str]:
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
        return seq, h


# --- reading -------------------------------------------------------------------------------------
_COLUMNS = ("seq", "id", "kind", "time", "tenant", "body", "prev_hash", "hash")
_TYPES = ("integer", "text", "text", "real", "text", "text", "text", "text")  # as SQLite's typeof() names them


def _rows(path: Path, where: str = "", args: tuple = ()) -> Iterator[tuple]:
    """Each row's columns as stored (text as bytes: it may not be UTF-8), then their SQLite types."""
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no witness log there")
    conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    conn.text_factory = bytes
    try:
        yield from conn.execute(f"SELECT {', '.join(_COLUMNS)}, {', '.join(f'typeof({c})' for c in _COLUMNS)} "
                                f"FROM entries {where} ORDER BY seq", args)
    finally:
        conn.close()


def _decode(row: tuple) -> tuple[list, dict[str, Any]] | str:
    """A row's fields as the writer wrote them and its body parsed, or what is wrong with it."""
    fields: list = []
    for name, want, got, value in zip(_COLUMNS, _TYPES, row[8:], row[:8]):
        if (stored := got.decode()) != want:
            return f"its {name} is {'NULL' if stored == 'null' else stored}, not {want}"
        try:
            fields.append(value.decode() if isinstance(value, bytes) else value)
        except UnicodeDecodeError:
            return f"its {name} is not UTF-8"
    try:
        body = json.loads(fields[5])
    except (ValueError, RecursionError):
        return "its body is not JSON"
    return (fields, body) if isinstance(body, dict) else "its body is not a JSON object"


def _shown(value: Any) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


@dataclass(frozen=True)
class Verdict:
    entries: int  # the entries that verify (before the break)
    broken_at: int | None = None  # seq of the first entry that does not fit the chain (or is missing)
    broken_id: str | None = None
    reason: str | None = None  # why it fails: a break, or a signed head that is missing or does not verify
    tail: str | None = None  # with ok: what the signed head says of the tail (or that it went unchecked)

    @property
    def ok(self) -> bool:
        return self.reason is None


def verify(path: str | Path, key: bytes | None = None) -> Verdict:
    """Recompute the chain from the first entry; the first entry that is malformed, out of sequence,
    pointing to another previous hash, or whose hash is not its content's, breaks it. With the key,
    the log must then match its signed head: as many entries at least, the head's entry its hash."""
    path = Path(path).expanduser()
    try:
        head = None if key is None else read_head(path, key)
    except WitnessError as e:
        head = str(e)
    count = head[0] if isinstance(head, tuple) else -1
    prev, expected, n, at_head = GENESIS, 1, 0, (None, None)
    try:
        for row in _rows(path):
            decoded = _decode(row)
            if isinstance(decoded, str):
                return Verdict(n, row[0] if isinstance(row[0], int) else expected, _shown(row[1]), decoded)
            (seq, id, kind, t, tenant, body_json, prev_hash, h), _ = decoded
            if seq != expected:
                return Verdict(n, seq, id, f"entry {expected} is missing (the next is {seq})")
            if prev_hash != prev:
                return Verdict(n, seq, id, "its previous hash is not the previous entry's hash")
            if entry_hash(prev_hash, seq, id, kind, t, tenant, body_json) != h:
                return Verdict(n, seq, id, "its content does not match its hash")
            prev, expected, n = h, seq + 1, n + 1
            if seq == count:
                at_head = (h, id)
    except sqlite3.DatabaseError as e:
        return Verdict(n, expected, None, f"the log cannot be read from here ({e})")
    if head is None:
        return Verdict(n, tail="unchecked (no key file: entries cut from the end would go unnoticed)")
    if isinstance(head, str):
        return Verdict(n, reason=head)
    problem = _head_mismatch(head, n, at_head[0])
    if problem:
        return Verdict(n, n + 1, None, problem) if n < count else Verdict(0, count, at_head[1], problem)
    after = f"; the {n - count} entries after it are not covered by it yet" if n > count else ""
    return Verdict(n, tail=f"matches the signed head of {_when(head[2])} ({count} entries){after}")


def find(path: str | Path, id: str) -> list[Entry]:
    """Every entry with this id (a completion, and the feedback on it), or with this sequence number;
    WitnessError on a malformed one."""
    entries = []
    for row in _rows(Path(path).expanduser(), "WHERE id = ? OR seq = ?", (id, int(id) if id.isdigit() else -1)):
        decoded = _decode(row)
        if isinstance(decoded, str):
            raise WitnessError(f"entry {_shown(row[0])} is malformed: {decoded} (ruvllm witness verify)")
        (seq, eid, kind, t, tenant, _, prev, h), body = decoded
        entries.append(Entry(seq, eid, kind, t, tenant, body, prev, h))
    return entries
