"""The witness log: a hash chain in SQLite that verifies, names the first entry tampered with,
missing or malformed, survives the writer being killed mid-write; the signed head that catches a
cut or rewritten tail; and the `ruvllm witness` commands."""

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
from ruvllm.witness.log import WitnessError, WitnessLog, entry_hash, find, head_path, read_key, verify

if not any(g.name == "witness" for g in cli_main.app.registered_groups):
    cli_main._register()


def _fill(path: Path, n: int, key_file: Path | None = None) -> None:
    log = WitnessLog(path, model_digest=lambda: "sha256:abc", key_file=key_file)
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
    (tmp_path / "junk.sqlite3").write_bytes(b"not a database" * 100)
    junk = runner.invoke(cli_main.app, ["witness", "verify", "--path", str(tmp_path / "junk.sqlite3")])
    assert junk.exit_code == 1 and "breaks at entry 1: the log cannot be read from here" in junk.output


@pytest.fixture
def key_file(tmp_path: Path) -> Path:
    (tmp_path / "key").write_text("a secret key\n")
    return tmp_path / "key"


def test_a_cut_tail_is_caught_by_the_signed_head(tmp_path: Path, key_file: Path) -> None:
    path = tmp_path / "w.sqlite3"
    _fill(path, 20, key_file)
    key = read_key(key_file)
    v = verify(path, key)
    assert v.ok and v.entries == 20 and v.tail.endswith(" (20 entries)")
    unchecked = verify(path)  # without the key: the chain only
    assert unchecked.ok and unchecked.entries == 20 and "unchecked" in unchecked.tail
    with sqlite3.connect(path) as conn:
        conn.execute("DELETE FROM entries WHERE seq > 17")
    assert verify(path).ok  # the chain alone cannot tell
    v = verify(path, key)
    assert not v.ok and v.broken_at == 18 and "entries 18 to 20 are missing" in v.reason
    with pytest.raises(WitnessError, match="entries 18 to 20 are missing"):  # a writer will not sign over the cut
        WitnessLog(path, key_file=key_file)
    other = tmp_path / "other"
    other.write_text("another key")
    v = verify(path, read_key(other))
    assert not v.ok and v.broken_at is None and "does not verify" in v.reason


def test_a_full_rewrite_with_recomputed_hashes_is_caught_by_the_signed_head(tmp_path: Path, key_file: Path) -> None:
    path = tmp_path / "w.sqlite3"
    _fill(path, 10, key_file)
    with sqlite3.connect(path) as conn:  # entry 4 changed, and every hash from there recomputed
        rows = conn.execute("SELECT seq, id, kind, time, tenant, body, prev_hash FROM entries ORDER BY seq").fetchall()
        prev = rows[3][6]
        for seq, id, kind, t, tenant, body, _ in rows[3:]:
            body = body.replace('"tokens":3', '"tokens":33')
            h = entry_hash(prev, seq, id, kind, t, tenant, body)
            conn.execute("UPDATE entries SET body = ?, prev_hash = ?, hash = ? WHERE seq = ?", (body, prev, h, seq))
            prev = h
    assert verify(path).ok
    v = verify(path, read_key(key_file))
    assert not v.ok and (v.broken_at, v.broken_id) == (10, "cmpl-9") and "rewritten" in v.reason


def test_rows_after_the_head_are_reported_and_the_next_writer_signs_them(tmp_path: Path, key_file: Path) -> None:
    path = tmp_path / "w.sqlite3"
    _fill(path, 5, key_file)
    with pytest.raises(WitnessError, match="has a signed head .*give its key"):
        WitnessLog(path)  # a writer without the key would append what the head never vouches for
    # rows past the head, as a writer killed between its commit and its head write leaves them
    head = head_path(path).read_bytes()
    head_path(path).unlink()
    _fill(path, 2)
    head_path(path).write_bytes(head)
    v = verify(path, read_key(key_file))
    assert v.ok and v.entries == 7 and "the 2 entries after it are not covered" in v.tail
    _fill(path, 1, key_file)
    assert verify(path, read_key(key_file)).tail.endswith(" (8 entries)")
    head_path(path).unlink()
    v = verify(path, read_key(key_file))
    assert not v.ok and v.entries == 8 and "no signed head" in v.reason


@pytest.mark.parametrize("column, value, reason", [
    ("body", b'{"n": 1}', "its body is blob, not text"),
    ("body", None, "its body is NULL, not text"),
    ("tenant", "CAST(X'ff00fe' AS TEXT)", "its tenant is not UTF-8"),
    ("body", "{not json", "its body is not JSON"),
    ("body", "[1]", "its body is not a JSON object"),
    ("time", "noon", "its time is text, not real"),
    ("seq", None, "its seq is NULL, not integer"),  # sorted first: the break is where entry 1 was due
])
def test_a_malformed_row_is_a_break_at_that_entry(tmp_path: Path, wide_terminal: None, column: str, value: object,
                                                  reason: str) -> None:
    path = tmp_path / "w.sqlite3"
    _fill(path, 9)
    with sqlite3.connect(path) as conn:  # a table without the constraints, as anyone with the file can make
        conn.executescript("CREATE TABLE e2 AS SELECT * FROM entries; DROP TABLE entries; "
                           "ALTER TABLE e2 RENAME TO entries")
        if isinstance(value, str) and value.startswith("CAST"):
            conn.execute(f"UPDATE entries SET {column} = {value} WHERE seq = 7")
        else:
            conn.execute(f"UPDATE entries SET {column} = ? WHERE seq = 7", (value,))
    at, before = (1, 0) if column == "seq" else (7, 6)
    v = verify(path)
    assert (v.broken_at, v.broken_id, v.reason, v.entries) == (at, "cmpl-6", reason, before)
    out = CliRunner().invoke(cli_main.app, ["witness", "verify", "--path", str(path)])
    assert out.exit_code == 1 and isinstance(out.exception, SystemExit) and "Traceback" not in out.output
    assert f"breaks at entry {at} (id cmpl-6): {reason}" in out.output
    if column != "seq":
        shown = CliRunner().invoke(cli_main.app, ["witness", "show", "cmpl-6", "--path", str(path)])
        assert shown.exit_code == 1 and f"entry 7 is malformed: {reason}" in shown.output


def test_show_lists_the_entries_an_id_matches(tmp_path: Path, wide_terminal: None) -> None:
    path = tmp_path / "w.sqlite3"
    _fill(path, 2)
    _fill(path, 1)  # a second process that numbered its ids from 0 again
    log = WitnessLog(path)  # one request of two prompts, and feedback on it: one completion, listed
    for entry in ({"prompt_index": 0}, {"prompt_index": 1}):
        log.append("cmpl-two", "completion", "default", entry)
    log.append("cmpl-two", "feedback", "default", {"score": 1})
    log.close()
    runner = CliRunner()
    shown = runner.invoke(cli_main.app, ["witness", "show", "cmpl-0", "--path", str(path)])
    assert shown.exit_code == 0 and "'cmpl-0' matches 2 entries, several of them different completions" in shown.output
    assert "entry 1: completion cmpl-0" in shown.output and "entry 3: completion cmpl-0" in shown.output
    assert shown.output.count('"seq"') == 2
    one = runner.invoke(cli_main.app, ["witness", "show", "cmpl-1", "--path", str(path)])
    assert one.exit_code == 0 and "matches" not in one.output and one.output.count('"seq"') == 1
    request = runner.invoke(cli_main.app, ["witness", "show", "cmpl-two", "--path", str(path)])
    assert request.exit_code == 0 and "'cmpl-two' matches 3 entries:" in request.output
    assert "different completions" not in request.output and "entry 6: feedback cmpl-two" in request.output
    assert "entry 5: completion cmpl-two at " in request.output and ", prompt 1" in request.output


def test_cli_verify_with_a_key_file(tmp_path: Path, key_file: Path, wide_terminal: None) -> None:
    path = tmp_path / "w.sqlite3"
    _fill(path, 6, key_file)
    runner = CliRunner()
    ok = runner.invoke(cli_main.app, ["witness", "verify", "--path", str(path), "--key-file", str(key_file)])
    assert ok.exit_code == 0 and "6 entries, the chain verifies; the tail: matches the signed head" in ok.output
    plain = runner.invoke(cli_main.app, ["witness", "verify", "--path", str(path)])
    assert plain.exit_code == 0 and "the tail: unchecked (no key file" in plain.output
    with sqlite3.connect(path) as conn:
        conn.execute("DELETE FROM entries WHERE seq = 6")
    cut = runner.invoke(cli_main.app, ["witness", "verify", "--path", str(path), "--key-file", str(key_file)])
    assert cut.exit_code == 1 and "the chain breaks at entry 6: entry 6 is missing: the signed head of " in cut.output
    assert "records 6 entries; the 5 entries before it verify" in cut.output
