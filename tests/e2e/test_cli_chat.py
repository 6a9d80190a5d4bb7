"""`ruvllm chat` driven through a pseudo-terminal, as a person would use it: type, read the stream,
use the /commands, press Ctrl-C mid-reply (the chat must survive it), then /quit."""

from __future__ import annotations

import fcntl
import os
import re
import select
import signal
import struct
import subprocess
import sys
import termios
import time
from pathlib import Path

import pytest

RUVLLM = Path(sys.executable).with_name("ruvllm")
PROMPT = ">>> "
# Colour, cursor and bracketed-paste sequences, and the carriage returns of the terminal's line endings.
_NOISE = re.compile(r"\x1b\[[0-9;?]*[ -/]*[@-~]|\x1b[()][0-9A-Za-z]|\x1b[=>]|\r")


class Terminal:
    """The master side of a pty with a child on the slave side as its controlling terminal."""

    def __init__(self, argv: list[str]) -> None:
        self.master, slave = os.openpty()
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 50, 200, 0, 0))
        env = {**os.environ, "NO_COLOR": "1", "TERM": "dumb", "COLUMNS": "200"}

        def controlling_tty() -> None:
            # New session (start_new_session), then take the pty as its terminal: only then does
            # the line discipline turn a written ^C into SIGINT for the child.
            fcntl.ioctl(0, termios.TIOCSCTTY, 0)

        self.proc = subprocess.Popen(argv, stdin=slave, stdout=slave, stderr=slave, env=env,
                                     start_new_session=True, preexec_fn=controlling_tty)
        os.close(slave)
        self.text = ""  # everything read so far, without terminal noise
        self.pos = 0  # where the next expect() starts looking

    def _read(self, timeout: float) -> None:
        ready, _, _ = select.select([self.master], [], [], timeout)
        if ready:
            try:
                data = os.read(self.master, 65536)
            except OSError:  # EIO: the child closed its side
                data = b""
            if not data:
                raise EOFError(f"child exited (rc={self.proc.poll()}); output:\n{self.text}")
            self.text = _NOISE.sub("", self.text + data.decode("utf-8", "replace"))

    def expect(self, pattern: str, timeout: float = 30.0) -> str:
        """Wait for `pattern` (a regex) after the previous match; return the text skipped to reach it."""
        deadline = time.monotonic() + timeout
        while True:
            match = re.compile(pattern).search(self.text, self.pos)
            if match:
                skipped = self.text[self.pos:match.start()]
                self.pos = match.end()
                return skipped
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"timed out waiting for {pattern!r}; output:\n{self.text}")
            self._read(min(left, 1.0))

    def send(self, data: bytes) -> None:
        os.write(self.master, data)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)
        os.close(self.master)


@pytest.fixture
def term():
    t = Terminal([str(RUVLLM), "chat", "--temperature", "0", "--max-tokens", "24"])
    yield t
    t.close()


def test_chat_session_through_a_terminal(term: Terminal) -> None:
    term.expect(re.escape(PROMPT), timeout=90)  # loading the model

    term.send(b"What is the capital of France?\n")
    reply = term.expect(re.escape(PROMPT))
    answer = reply.split("\n", 1)[1]  # after the echoed question
    assert answer.strip(), f"empty reply: {term.text}"

    term.send(b"/help\n")
    assert "/clear" in term.expect(re.escape(PROMPT))
    term.send(b"/system You answer briefly.\n")
    term.expect("system prompt set")
    term.send(b"/temp 0.5\n")
    term.expect(r"temperature 0\.5")
    term.send(b"/temp abc\n")  # a bad value is one line, and the chat goes on
    term.expect("needs a number")
    term.send(b"/clear\n")
    term.expect("history cleared")
    term.send(b"/temp 0\n")
    term.expect("temperature 0.0")
    term.send(b"/max-tokens 2000\n")
    term.expect("max tokens 2000")
    term.expect(re.escape(PROMPT))

    term.send(b"Count from 1 to 500, separated by commas.\n")
    term.expect(r"separated by commas\.\n")  # the echo
    term.expect(r"\S.{20}")  # the reply is streaming
    term.send(b"\x03")  # Ctrl-C: stop this reply, not the program
    term.expect(r"\(stopped\)", timeout=15)
    term.expect(re.escape(PROMPT))
    assert term.proc.poll() is None

    term.send(b"/quit\n")
    assert term.proc.wait(15) == 0
