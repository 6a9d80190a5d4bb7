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

from tests.server.test_serve_process import _children, _front_folder, _wait_gone


def _maps(pid: int, library: str) -> bool:
    """Whether process `pid` has `library` mapped (Linux /proc)."""
    with open(f"/proc/{pid}/maps") as f:
        return library in f.read()

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
            # A person's terminal starts programs with SIGINT at its default; a test run started in
            # the background by a non-interactive shell (CI) ignores it, and the child would inherit that.
            signal.signal(signal.SIGINT, signal.SIG_DFL)

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
    t = Terminal([str(RUVLLM), "chat", "--temperature", "0", "--max-tokens", "24",
                  "--dtype", "float32", "--quantization", "none"])  # the fp32 reference: the greedy answer
    # the test expects (bf16, or the packed default, flips a near-tie)
    yield t
    t.close()


def test_chat_session_through_a_terminal(term: Terminal) -> None:
    term.expect(re.escape(PROMPT), timeout=90)  # loading the model

    def say(line: str, answer: str) -> str:
        """Type a line at the prompt; wait for `answer` and the next prompt; return what was shown."""
        term.send(line.encode() + b"\n")
        shown = term.expect(answer)
        term.expect(re.escape(PROMPT))
        return shown

    say("What is the capital of France?", "Paris")
    # the front needs no tensor and runs without torch: the model is the core process's (loader/
    # gguf_file.py reads configs without it; docs/decisions.md, session 22)
    (core,) = _children(term.proc.pid)
    assert _maps(core, "libtorch_cpu") and not _maps(term.proc.pid, "libtorch_cpu")
    say("/help", "/clear")
    say("/system You answer briefly.", "system prompt set")
    say("/temp 0.5", r"temperature 0\.5")
    say("/temp abc", "needs a number")  # a bad value is one line, and the chat goes on
    say("/temp -1", "needs a number")
    say("/clear", "history cleared")
    say("/temp 0", r"temperature 0\.0")
    say("/max-tokens 2000", "max tokens 2000")

    term.send(b"Write the numbers 1, 2, 3, and so on up to 500.\n")
    term.expect(r"(\d+, ){6}", timeout=30)  # the reply is streaming (the echoed question has only 3)
    term.send(b"\x03")  # Ctrl-C: stop this reply, not the program
    term.expect(r"\(stopped\)", timeout=15)
    term.expect(re.escape(PROMPT))
    assert term.proc.poll() is None
    say("/temp", r"temperature 0\.0")  # still answering

    term.send(b"/quit\n")
    assert term.proc.wait(15) == 0


def test_chat_through_a_lora_adapter(tiny_model_dir: Path, tmp_path: Path) -> None:
    """`ruvllm chat MODEL --lora PATH` replies through the adapter: the text LLM.chat gives with it."""
    from ruvllm import LLM, SamplingParams
    from tests.lora_fixtures import make_adapter

    make_adapter(tiny_model_dir, tmp_path / "tone", seed=5)
    question = "w1 w2 w3 w4"
    llm = LLM(str(tiny_model_dir), enable_lora=True, max_loras=1)
    params = SamplingParams(temperature=0, top_p=0.9, max_tokens=8)
    message = [{"role": "user", "content": question}]
    expected = llm.chat(message, params, lora=str(tmp_path / "tone"))[0].outputs[0].text
    assert expected != llm.chat(message, params)[0].outputs[0].text  # the adapter shows in the reply
    t = Terminal([str(RUVLLM), "chat", str(tiny_model_dir), "--lora", str(tmp_path / "tone"), "--temperature", "0",
                  "--max-tokens", "8"])
    try:
        t.expect(r"\+ adapter tone", timeout=90)
        t.expect(re.escape(PROMPT), timeout=30)
        t.send(question.encode() + b"\n")
        shown = t.expect(re.escape(PROMPT), timeout=30)
        reply = [line for line in shown.split("(cut at max tokens")[0].splitlines()
                 if line.strip() and line.strip() != question]  # the terminal echoes the typed line
        assert "\n".join(reply).strip() == expected.strip()
        # Killed instead of /quit (which the session test above checks), as
        # tests/server/test_serve_process.py's killed server was (a server start spared there): SIGKILL
        # gives the front no chance to stop its child; the engine core notices and leaves by itself.
        (core,) = _children(t.proc.pid)
        # the front's folder (its command socket's), which the core removes as it leaves: the front's
        # death hangs up the terminal, and a core ended by that SIGHUP had left the folder behind
        folder = _front_folder(core)
        assert folder.is_dir()
        t.proc.kill()
        t.proc.wait(10)
        assert _wait_gone(core), "the engine core was orphaned"
        assert not folder.exists(), "the engine core left its front's folder behind"
    finally:
        t.close()


def test_chat_refuses_a_model_without_a_chat_template(tiny_model_dir: Path, tmp_path: Path) -> None:
    """A base model (Gemma 3 270M ships none) cannot chat: one line that says so, exit code 1."""
    import json
    import shutil

    base = tmp_path / "base"
    shutil.copytree(tiny_model_dir, base)
    config = json.loads((base / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (base / "tokenizer_config.json").write_text(json.dumps(config))
    (base / "chat_template.jinja").unlink(missing_ok=True)
    # The command in this process (typer's runner: the code `ruvllm chat` runs, its core process
    # included), not a `ruvllm` of its own: that was an interpreter and its imports more for one
    # line (the other tests here run the real `ruvllm` in a terminal).
    from typer.testing import CliRunner

    from ruvllm.cli import main as cli_main

    if not any(c.name == "chat" for c in cli_main.app.registered_commands):
        cli_main._register()
    out = CliRunner().invoke(cli_main.app, ["chat", str(base)], input="hello\n")
    assert out.exit_code == 1, out.output
    assert out.stderr.strip().splitlines()[-1] == ("error: base has no chat template (a base model), so it cannot "
                                                   "chat; `ruvllm serve` serves its completions")
