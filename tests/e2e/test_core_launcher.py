"""Engine cores forked from a CoreLauncher (engine/core_launcher.py): a forked core serves what an
in-process engine does, with the front's environment, working folder and CPUs as they are at the
launch; its exit status comes back through the launcher; and whatever dies first, the launcher or
the core, nothing is left behind and the next launch works."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ruvllm import LLM, AsyncEngine, SamplingParams
from ruvllm.engine.core_launcher import CoreLauncher
from ruvllm.engine.llm import build_engine_config
from ruvllm.outputs import OutputKind
from tests.server.test_serve_process import _children, _front_folder, _wait_gone

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
PROMPTS = [[5, 6, 7, 8, 9], [11, 12, 13]]


def _ppid(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])


def _greedy(engine: AsyncEngine) -> list[list[int]]:
    async def one(i: int) -> list[int]:
        last = None
        async for out in engine.generate(PROMPTS[i], GREEDY, f"g{i}", output_kind=OutputKind.FINAL_ONLY):
            last = out
        assert last is not None
        return list(last.outputs[0].token_ids)

    async def both() -> list[list[int]]:
        return list(await asyncio.gather(*(one(i) for i in range(len(PROMPTS)))))

    return asyncio.run(both())


def test_a_forked_core_serves_as_in_process_and_reports_its_exit(tiny_model_dir, tmp_path, monkeypatch) -> None:
    expected = [o.outputs[0].token_ids for o in LLM(str(tiny_model_dir)).generate(PROMPTS, GREEDY)]
    launcher = CoreLauncher()
    try:
        # Changed after the launcher started: what the core gets is the front's state at the launch
        # (the model's path is relative to the new working folder; the environment is applied the
        # same way, by the child before it runs the core, where /proc shows only the launcher's).
        (tmp_path / "models").symlink_to(tiny_model_dir.parent)
        monkeypatch.chdir(tmp_path)
        config = build_engine_config(os.path.join("models", tiny_model_dir.name), num_threads=1)
        engine = AsyncEngine.launch(config, launcher=launcher)
        core = engine._client.process
        try:
            assert _ppid(core.pid) == launcher.pid
            assert os.readlink(f"/proc/{core.pid}/cwd") == str(tmp_path)
            assert _greedy(engine) == expected
            with pytest.raises(subprocess.TimeoutExpired):
                core.wait(timeout=0.1)
        finally:
            engine.shutdown()
        assert core.returncode == 0  # asked to leave, it left cleanly

        cpus = {min(os.sched_getaffinity(0))}  # one CPU: on a machine of several, not the default
        from ruvllm.engine.core_client import ProcessCoreClient

        client = ProcessCoreClient(config, cpus=cpus, launcher=launcher)
        try:
            client.wait_ready()
            assert os.sched_getaffinity(client.process.pid) == cpus
            # SIGTERM, not SIGKILL: -15 is the launcher's report, where -9 is also what a core whose
            # launcher died reads as.
            os.kill(client.process.pid, signal.SIGTERM)
            assert client.process.wait(timeout=10) == -signal.SIGTERM
        finally:
            client.shutdown()
    finally:
        launcher.close()
    assert launcher._proc is not None and launcher._proc.returncode == 0  # it left at its end of file
    with pytest.raises(OSError, match="closed"):
        launcher.launch(config, "ipc:///nowhere", (0, 0), {}, None)


def test_a_killed_launcher_takes_its_cores_with_it_and_the_next_launch_starts_another(tiny_model_dir) -> None:
    config = build_engine_config(str(tiny_model_dir), num_threads=1)
    launcher = CoreLauncher()
    try:
        engine = AsyncEngine.launch(config, launcher=launcher)
        core, first = engine._client.process, launcher.pid
        try:
            os.kill(first, signal.SIGKILL)
            # The core sees its parent change and leaves (core_process.py); its status died with the
            # launcher, so it reads as killed.
            assert core.wait(timeout=10) == -signal.SIGKILL
        finally:
            engine.shutdown()
        again = AsyncEngine.launch(config, launcher=launcher)
        try:
            assert launcher.pid != first and _ppid(again._client.process.pid) == launcher.pid
            assert len(_greedy(again)[0]) == GREEDY.max_tokens
        finally:
            again.shutdown()
    finally:
        launcher.close()


FRONT = """
import sys, time
from ruvllm import AsyncEngine
from ruvllm.engine.core_launcher import CoreLauncher
from ruvllm.engine.llm import build_engine_config
launcher = CoreLauncher()
engine = AsyncEngine.launch(build_engine_config(sys.argv[1], num_threads=1), launcher=launcher)
print(launcher.pid, engine._client.process.pid, engine._client._tmp.name, flush=True)
time.sleep(600)
"""


def test_a_killed_front_leaves_neither_launcher_nor_core(tiny_model_dir) -> None:
    """SIGKILL to the front, which runs nothing at its end: the launcher sees its socket's end of
    file and leaves, and its core sees its parent change and leaves too, removing the folder of the
    front's command socket, which the front had no chance to."""
    front = subprocess.Popen([sys.executable, "-c", FRONT, str(tiny_model_dir)], stdout=subprocess.PIPE, text=True)
    try:
        launcher, core, folder = front.stdout.readline().split()
        launcher, core = int(launcher), int(core)
        assert _ppid(core) == launcher and os.path.isdir(folder)
    finally:
        front.kill()
        front.wait()
    assert _wait_gone(launcher) and _wait_gone(core)
    assert not os.path.exists(folder)


LOADING_FRONT = """
import sys
from ruvllm import AsyncEngine
from ruvllm.engine.llm import build_engine_config
AsyncEngine.launch(build_engine_config(sys.argv[1], num_threads=1))
"""


def test_a_front_killed_while_its_core_loads_leaves_neither_core_nor_folder(tiny_model_dir) -> None:
    """SIGKILL to a front (a fresh interpreter's core, no launcher) as soon as its core exists, long
    before the core's Ready: the core finds the front gone when it says Ready, and leaves as it
    does from its loop, removing the folder of the front's command socket."""
    front = subprocess.Popen([sys.executable, "-c", LOADING_FRONT, str(tiny_model_dir)])
    try:
        core, deadline = None, time.monotonic() + 60
        while core is None and front.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)  # (a child is the core once it has exec'd: its command line names it)
            core = next((pid for pid in _children(front.pid)
                         if b"ruvllm.engine.core_process" in Path(f"/proc/{pid}/cmdline").read_bytes()), None)
        assert core is not None, "the front started no core"
        folder = _front_folder(core)
        assert folder.is_dir()
    finally:
        front.kill()
        front.wait()
    assert _wait_gone(core, timeout=60)
    assert not folder.exists()
