"""The witness log: a hash chain in SQLite that verifies, names the first entry tampered with or
missing, survives the writer being killed mid-write, and the `ruvllm witness` commands."""

from __future__ import annotations

import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from ruvllm.cli import main as cli_main
from ruvllm.witness.log import WitnessLog, find, verify

if not any(g.name == "witness" for g in cli_main.app.registered_groups):
    cli_main._register()


def _fill(path: Path, n: int) -> None:
    log = WitnessLog(path, model_digest=lambda: "sha256:abc")
    for i in range(n):
        log.append(f"cmpl-{i}", "completion", "default", {"prompt_hash": f"{i:064x}", "outputs": [{"tokens": i}]})
    log.close()


def test_the_chain_verifies_and_names_the_first_broken_entry(tmp_path: Path) -> None:
    path = tmp_path / "w.sqlite3"
    _fill(path, 20)
    assert verify(path).ok and verify(path).entries == 20
    (entry,) = find(path, "cmpl-7")
    assert entry.seq == 8 and entry.body["model_digest"] == "sha256:abc" and entry.body["outputs"] == [{"tokens": 7}]
    with sqlite3.connect(path) as conn:
        conn.execute("UPDATE entries SET body = replace(body, '\"tokens\":4', '\"tokens\":40') WHERE seq = 5")
    v = verify(path)
    assert (v.broken_at, v.broken_id, v.entries) == (5, "cmpl-4", 4) and "content" in v.reason
    with sqlite3.connect(path) as conn:
        conn.execute("DELETE FROM entries WHERE seq <= 5")
    v = verify(path)
    assert v.broken_at == 6 and "entry 1 is missing" in v.reason


def test_a_reopened_log_continues_the_chain(tmp_path: Path) -> None:
    path = tmp_path / "w.sqlite3"
    _fill(path, 3)
    _fill(path, 3)
    assert verify(path).entries == 6 and verify(path).ok


_WRITER = """
import sys, itertools
from ruvllm.witness.log import WitnessLog
log = WitnessLog(sys.argv[1])
for i in itertools.count():
    log.append(f"cmpl-{i}", "completion", "default", {"n": i, "pad": "x" * 2000})
    if i % 500 == 0:
        log.flush()
        print(i, flush=True)
"""


def test_kill_9_mid_write_never_breaks_the_chain(tmp_path: Path) -> None:
    path = tmp_path / "w.sqlite3"
    for _ in range(2):  # killed twice, the second time appending to what the first left
        proc = subprocess.Popen([sys.executable, "-c", _WRITER, str(path)], stdout=subprocess.PIPE, text=True)
        assert proc.stdout is not None
        for _ in range(3):
            proc.stdout.readline()  # it has committed 1,000 entries or more
        time.sleep(0.05)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        v = verify(path)
        assert v.ok and v.entries >= 1000, v


def test_cli_verify_and_show(tmp_path: Path, wide_terminal: None) -> None:
    path = tmp_path / "w.sqlite3"
    _fill(path, 5)
    runner = CliRunner()
    ok = runner.invoke(cli_main.app, ["witness", "verify", "--path", str(path)])
    assert ok.exit_code == 0 and "5 entries, the chain verifies" in ok.output
    shown = runner.invoke(cli_main.app, ["witness", "show", "cmpl-2", "--path", str(path)])
    assert shown.exit_code == 0 and '"seq": 3' in shown.output and '"prev_hash"' in shown.output
    with sqlite3.connect(path) as conn:
        conn.execute("UPDATE entries SET tenant = 'mallory' WHERE seq = 4")
    bad = runner.invoke(cli_main.app, ["witness", "verify", "--path", str(path)])
    lines = [line for line in bad.output.splitlines() if line.strip()]
    assert bad.exit_code == 1 and len(lines) == 1 and "breaks at entry 4 (id cmpl-3)" in lines[0]
    missing = runner.invoke(cli_main.app, ["witness", "show", "nope", "--path", str(path)])
    assert missing.exit_code == 1 and "no witness entry has id 'nope'" in missing.output
    none = runner.invoke(cli_main.app, ["witness", "verify", "--path", str(tmp_path / "none.sqlite3")])
    assert none.exit_code == 1 and "no witness log there" in none.output
