"""The policy store (SQLite): every learned adapter version, which one serves each tenant, and the
history of what changed that (publishes, rollbacks, resets) with the figures behind each.

The server reads it at start-up (learned adapters survive a restart) and again whenever another
connection has changed it (`PRAGMA data_version`: `ruvllm learn rollback` and `reset` take effect on
a running server at its next request).
"""

from __future__ import annotations

import json
import sqlite3
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

_SCHEMA = """
CREATE TABLE IF NOT EXISTS versions (
    tenant TEXT NOT NULL, version INTEGER NOT NULL, path TEXT NOT NULL, created REAL NOT NULL,
    source TEXT NOT NULL, checks TEXT NOT NULL, PRIMARY KEY (tenant, version));
CREATE TABLE IF NOT EXISTS serving (tenant TEXT PRIMARY KEY, version INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS history (
    time REAL NOT NULL, tenant TEXT NOT NULL, action TEXT NOT NULL, version INTEGER, detail TEXT NOT NULL);
"""


@dataclass(frozen=True)
class Version:
    tenant: str
    version: int
    path: str
    created: float
    source: str  # instant | background | deep
    checks: dict[str, Any]


class PolicyStore:
    def __init__(self, path: str | Path) -> None:
        self.path = Path(path).expanduser()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._conn = sqlite3.connect(str(self.path), isolation_level=None, check_same_thread=False, timeout=10)
        self._conn.execute("PRAGMA journal_mode=WAL")
        # Durable against the process dying, not against the machine losing power (as the witness log:
        # FULL's fsync at every commit was ~2-3 ms of each update's publish; issue 37 item 1). What power
        # loss can cost: the last publishes' rows, so a restart serves an earlier version of the tenant.
        self._conn.execute("PRAGMA synchronous=NORMAL")
        self._conn.executescript(_SCHEMA)
        self._lock = threading.Lock()
        self._seen = self._data_version()

    def close(self) -> None:
        self._conn.close()

    # --- changes from elsewhere ------------------------------------------------------------------
    def _data_version(self) -> int:
        with_lock = self._conn.execute("PRAGMA data_version").fetchone()
        return int(with_lock[0])

    def changed_elsewhere(self) -> bool:
        """True once after another connection (the CLI) committed a change."""
        with self._lock:
            now = self._data_version()
            changed, self._seen = now != self._seen, now
            return changed

    # --- writing ---------------------------------------------------------------------------------
    def _write(self, statements: list[tuple[str, tuple]]) -> None:
        with self._lock:
            self._conn.execute("BEGIN IMMEDIATE")
            try:
                for sql, args in statements:
                    self._conn.execute(sql, args)
                self._conn.execute("COMMIT")
            except BaseException:
                self._conn.execute("ROLLBACK")
                raise
            self._seen = self._data_version()  # our own change is not news

    def publish(self, tenant: str, version: int, path: str | Path, source: str, checks: dict[str, Any]) -> None:
        """A new version, now serving the tenant."""
        now = time.time()
        self._write([
            ("INSERT INTO versions VALUES (?, ?, ?, ?, ?, ?)", (tenant, version, str(path), now, source,
                                                                json.dumps(checks))),
            ("INSERT OR REPLACE INTO serving VALUES (?, ?)", (tenant, version)),
            ("INSERT INTO history VALUES (?, ?, ?, ?, ?)", (now, tenant, "publish", version, json.dumps(checks))),
        ])

    def forget(self, tenant: str, versions: list[int]) -> None:
        """Versions whose folders were deleted: no longer listed or rolled back to (history keeps them)."""
        self._write([("DELETE FROM versions WHERE tenant = ? AND version = ?", (tenant, v)) for v in versions]
                    + [("INSERT INTO history VALUES (?, ?, ?, ?, ?)", (time.time(), tenant, "prune", None,
                                                                        json.dumps({"versions": versions})))])

    def note(self, tenant: str, action: str, detail: dict[str, Any]) -> None:
        """A history entry that changes nothing served (a refused promotion and why)."""
        self._write([("INSERT INTO history VALUES (?, ?, ?, ?, ?)", (time.time(), tenant, action, None,
                                                                      json.dumps(detail)))])

    def rollback(self, tenant: str, version: int | None = None) -> Version:
        """Serve an earlier version (default: the one before the serving one). ValueError if none."""
        current = self.serving().get(tenant)
        known = self.versions(tenant)
        if version is None:
            earlier = [v for v in known if current is None or v.version < current]
            if not earlier:
                raise ValueError(f"tenant {tenant!r} has no version before {current} to roll back to")
            target = earlier[-1]
        else:
            target = next((v for v in known if v.version == version), None)
            if target is None:
                raise ValueError(f"tenant {tenant!r} has no version {version}")
        now = time.time()
        self._write([("INSERT OR REPLACE INTO serving VALUES (?, ?)", (tenant, target.version)),
                     ("INSERT INTO history VALUES (?, ?, ?, ?, ?)",
                      (now, tenant, "rollback", target.version, json.dumps({"from": current})))])
        return target

    def reset(self, tenant: str) -> None:
        """The tenant back on the base model (its versions stay listed)."""
        current = self.serving().get(tenant)
        self._write([("DELETE FROM serving WHERE tenant = ?", (tenant,)),
                     ("INSERT INTO history VALUES (?, ?, ?, ?, ?)",
                      (time.time(), tenant, "reset", None, json.dumps({"from": current})))])

    # --- reading ---------------------------------------------------------------------------------
    def serving(self) -> dict[str, int]:
        with self._lock:
            return dict(self._conn.execute("SELECT tenant, version FROM serving").fetchall())

    def versions(self, tenant: str) -> list[Version]:
        with self._lock:
            rows = self._conn.execute("SELECT tenant, version, path, created, source, checks FROM versions "
                                      "WHERE tenant = ? ORDER BY version", (tenant,)).fetchall()
        return [Version(t, v, p, c, s, json.loads(ch)) for t, v, p, c, s, ch in rows]

    def version(self, tenant: str, version: int) -> Version | None:
        return next((v for v in self.versions(tenant) if v.version == version), None)

    def last_version(self, tenant: str) -> int:
        with self._lock:
            row = self._conn.execute("SELECT MAX(version) FROM versions WHERE tenant = ?", (tenant,)).fetchone()
        return int(row[0] or 0)

    def tenants(self) -> list[str]:
        with self._lock:
            return [r[0] for r in self._conn.execute("SELECT DISTINCT tenant FROM versions ORDER BY tenant")]

    def history(self, tenant: str | None = None) -> list[tuple[float, str, str, int | None, dict]]:
        with self._lock:
            rows = self._conn.execute("SELECT time, tenant, action, version, detail FROM history "
                                      + ("WHERE tenant = ? " if tenant else "") + "ORDER BY rowid",
                                      (tenant,) if tenant else ()).fetchall()
        return [(t, tn, a, v, json.loads(d)) for t, tn, a, v, d in rows]
