"""LoRA adapters through the HTTP server and the real `openai` client: loading and unloading while
requests run, /v1/models, `model: NAME`, and bad input (each a clear 4xx, the server serving on).
The server runs over the tiny model's folder, with adapters made by peft at test time."""

from __future__ import annotations

import functools
import json
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from ruvllm import LLM, SamplingParams
from tests.lora_fixtures import make_adapter
from tests.server.conftest import MODEL, RunningServer, start_server


@pytest.fixture(scope="module")
def adapters(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("adapters")
    for i, name in enumerate(["a", "b", "c"]):
        make_adapter(tiny_model_dir, root / name, seed=20 + i)
    make_adapter(tiny_model_dir, root / "big", seed=30, r=32)
    corrupt = root / "corrupt"
    make_adapter(tiny_model_dir, corrupt, seed=31)
    (corrupt / "adapter_model.safetensors").write_bytes(b"not a safetensors file")
    nan = root / "nan"  # issue 33: a NaN lora_alpha loaded (200), then outputs were empty and streams bare NaN
    make_adapter(tiny_model_dir, nan, seed=32)
    config = json.loads((nan / "adapter_config.json").read_text())
    (nan / "adapter_config.json").write_text(json.dumps({**config, "lora_alpha": float("nan")}))
    return root


@pytest.fixture(scope="module")
def lora_llm(tiny_model_dir: Path) -> LLM:
    return LLM(str(tiny_model_dir), enable_lora=True, max_loras=4, max_lora_rank=16)


@pytest.fixture
def server(lora_llm: LLM, adapters: Path) -> Iterator[RunningServer]:
    yield from start_server(lora_llm, lora_dirs=(str(adapters),))


def load(server: RunningServer, name: str, path: Path | str, **headers: str) -> httpx.Response:
    return httpx.post(server.url + "/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(path)},
                      headers=headers, timeout=60)


def unload(server: RunningServer, name: str) -> httpx.Response:
    return httpx.post(server.url + "/v1/unload_lora_adapter", json={"lora_name": name}, timeout=60)


def client(server: RunningServer) -> openai.OpenAI:
    return _client(server.url)


@functools.cache
def _client(url: str) -> openai.OpenAI:
    """One a server: each new client builds an SSL context (~54 ms of CPU; tests/server/conftest.py)."""
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)


PROMPT = [5, 17, 99, 230, 41, 8, 77, 310, 12, 3, 250, 61]


def test_adapter_served_by_name_equals_offline(server: RunningServer, lora_llm: LLM, adapters: Path) -> None:
    r = load(server, "a", adapters / "a")
    assert r.status_code == 200 and "added successfully" in r.text
    models = {m.id: m for m in client(server).models.list().data}
    assert set(models) == {MODEL, "a"}
    assert models["a"].model_extra["parent"] == MODEL and models["a"].model_extra["root"] == "a"
    got = client(server).completions.create(model="a", prompt=PROMPT, max_tokens=10, temperature=0)
    assert got.model == "a"  # what the client asked for, as vLLM echoes it (the adapter is applied)
    assert all(c.model == "a" for c in client(server).chat.completions.create(
        model="a", messages=[{"role": "user", "content": "hi"}], max_tokens=3, stream=True))
    params = SamplingParams(temperature=0, max_tokens=10)
    expected = lora_llm.generate([PROMPT], params, lora=str(adapters / "a"))[0].outputs[0]
    assert got.choices[0].text == expected.text
    base = client(server).completions.create(model=MODEL, prompt=PROMPT, max_tokens=10, temperature=0)
    assert base.choices[0].text != got.choices[0].text
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client(server).completions.create(model="nope", prompt=PROMPT, max_tokens=2)
    r = unload(server, "a")
    assert r.status_code == 200 and "removed successfully" in r.text
    with pytest.raises(openai.NotFoundError):
        client(server).completions.create(model="a", prompt=PROMPT, max_tokens=2)


def test_hot_load_and_unload_while_streaming(server: RunningServer, adapters: Path) -> None:
    """16 streams (8 on adapter a, 8 on the base) run while b is loaded and a unloaded, then 4 on
    b: no request fails, a's streams finish, and every KV block is back (the fixture checks)."""
    assert load(server, "a", adapters / "a").status_code == 200
    errors: list[BaseException] = []
    tokens: list[int] = []
    started = threading.Barrier(17)

    def stream(model: str) -> None:
        try:
            chunks = client(server).completions.create(model=model, prompt=PROMPT, max_tokens=40, temperature=0,
                                                       stream=True, extra_body={"ignore_eos": True})
            started.wait(timeout=60)
            n = sum(1 for c in chunks if c.choices and c.choices[0].text)
            tokens.append(n)
        except BaseException as exc:  # noqa: BLE001 (collected and asserted on below)
            errors.append(exc)

    threads = [threading.Thread(target=stream, args=("a" if i % 2 else MODEL,)) for i in range(16)]
    for t in threads:
        t.start()
    started.wait(timeout=60)
    assert load(server, "b", adapters / "b").status_code == 200
    assert unload(server, "a").status_code == 200

    def on_b() -> None:
        try:
            out = client(server).completions.create(model="b", prompt=PROMPT, max_tokens=8, temperature=0,
                                                    extra_body={"ignore_eos": True})
            tokens.append(out.usage.completion_tokens)
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    later = [threading.Thread(target=on_b) for _ in range(4)]
    for t in later:
        t.start()
    for t in threads + later:
        t.join(timeout=120)
    assert not errors, errors
    assert tokens.count(40) == 16 and tokens.count(8) == 4
    assert {m.id for m in client(server).models.list().data} == {MODEL, "b"}
    assert unload(server, "b").status_code == 200


@pytest.mark.parametrize("case,status,fragment", [
    ("missing", 400, "no such folder"),
    ("corrupt", 400, "not a readable safetensors file"),
    ("rank", 400, "over the maximum 16"),
    ("nan-alpha", 400, "lora_alpha must be a positive finite number, got nan"),
    ("outside", 403, "does not load adapters from that path"),
    ("dotdot", 403, "does not load adapters from that path"),
    ("name-in-use", 400, "already in use"),
])
def test_bad_loads_are_4xx_and_the_server_serves_on(server: RunningServer, adapters: Path, tmp_path: Path,
                                                    case: str, status: int, fragment: str) -> None:
    path = {"missing": adapters / "nope", "corrupt": adapters / "corrupt", "rank": adapters / "big",
            "nan-alpha": adapters / "nan",
            "outside": tmp_path, "dotdot": f"{adapters}/../elsewhere", "name-in-use": adapters / "a"}[case]
    name = MODEL if case == "name-in-use" else "x"
    r = load(server, name, path)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert fragment in error["message"] and error["param"] in ("lora_path", "lora_name")
    assert {m["id"] for m in httpx.get(server.url + "/v1/models").json()["data"]} == {MODEL}
    assert client(server).completions.create(model=MODEL, prompt=PROMPT, max_tokens=2).choices[0].text is not None


def test_unload_unknown_is_404(server: RunningServer) -> None:
    r = unload(server, "ghost")
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


def test_loading_needs_the_api_key(lora_llm: LLM, adapters: Path) -> None:
    for srv in start_server(lora_llm, api_key="sekret", lora_dirs=(str(adapters),)):
        assert load(srv, "a", adapters / "a").status_code == 401
        assert load(srv, "a", adapters / "a", Authorization="Bearer sekret").status_code == 200
        r = httpx.post(srv.url + "/v1/unload_lora_adapter", json={"lora_name": "a"},
                       headers={"Authorization": "Bearer sekret"})
        assert r.status_code == 200


def test_lora_disabled_server_says_so(_tiny_llm: LLM, adapters: Path) -> None:
    for srv in start_server(_tiny_llm, lora_dirs=(str(adapters),)):
        r = load(srv, "a", adapters / "a")
        assert r.status_code == 400 and "not enabled" in r.json()["error"]["message"]


def test_serve_with_a_bad_lora_flag_is_one_line(tiny_model_dir: Path, tmp_path: Path) -> None:
    """The command in this process (typer's runner: the code `ruvllm serve` runs, its core process
    included), not a `ruvllm serve` of its own: that was an interpreter and its imports more for one
    line (tests/server/test_serve_process.py runs the real process, one-line failures included)."""
    from typer.testing import CliRunner

    from ruvllm.cli import main as cli_main

    if not any(c.name == "serve" for c in cli_main.app.registered_commands):
        cli_main._register()
    out = CliRunner().invoke(cli_main.app, ["serve", str(tiny_model_dir), "--port", "0",
                                            "--lora", f"x={tmp_path / 'none'}"])
    assert out.exit_code != 0 and isinstance(out.exception, SystemExit), out.exception  # not a traceback
    lines = [line for line in out.stderr.strip().splitlines() if line.strip()]
    assert "no such folder" in lines[-1] and "Traceback" not in out.stderr




def test_core_process_loads_serves_and_unloads(tiny_model_dir: Path, adapters: Path, lora_llm: LLM) -> None:
    """`ruvllm serve`'s arrangement: the core in a child process, the adapter read on a thread of that
    process and answered from it; the outputs are the offline engine's."""
    import asyncio

    from ruvllm.engine.async_engine import AsyncEngine
    from ruvllm.engine.llm import build_engine_config
    from ruvllm.errors import AdapterError, AdapterNotFoundError
    from ruvllm.outputs import OutputKind

    import shutil

    from ruvllm.errors import AdapterPathError
    from ruvllm.server.adapters import _identities

    engine = AsyncEngine.launch(build_engine_config(str(tiny_model_dir), enable_lora=True, max_loras=2, max_lora_rank=16))
    try:
        engine.load_lora("a", str(adapters / "a"), _identities(adapters / "a"))  # the server's check, sent over
        assert engine.loras == ["a"]
        shutil.copytree(adapters / "b", adapters / "b-process")
        checked = _identities(adapters / "b-process")
        weights = adapters / "b-process" / "adapter_model.safetensors"
        weights.rename(weights.with_suffix(".kept"))  # replaced after the check: the core process sees another
        shutil.copyfile(adapters / "c" / "adapter_model.safetensors", weights)  # inode (the old one is kept)
        with pytest.raises(AdapterPathError, match="another file than the one the path policy checked"):
            engine.load_lora("b", str(adapters / "b-process"), checked)
        with pytest.raises(AdapterError, match="over the maximum 16"):
            engine.load_lora("big", str(adapters / "big"))
        params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)

        async def run(lora: str | None) -> list[int]:
            out = None
            async for out in engine.generate(PROMPT, params, output_kind=OutputKind.FINAL_ONLY, lora=lora):
                pass
            return out.outputs[0].token_ids

        got = asyncio.run(run("a"))
        assert got == lora_llm.generate([PROMPT], params, lora=str(adapters / "a"))[0].outputs[0].token_ids
        engine.unload_lora("a")
        with pytest.raises(AdapterNotFoundError):
            asyncio.run(run("a"))
        stats = engine.stats()
        assert stats.adapters == [] and stats.free_blocks == stats.total_blocks
    finally:
        engine.shutdown()


def test_xlora_model_served_by_name(server: RunningServer, lora_llm: LLM, adapters: Path, tiny_model_dir: Path,
                                    tmp_path_factory: pytest.TempPathFactory) -> None:
    """An X-LoRA model loads like an adapter and answers as offline; one that mixes an adapter
    from outside the allowed folders is refused (403), and the server serves on."""
    import json
    import shutil

    from tests.lora_fixtures import make_xlora

    make_xlora(tiny_model_dir, adapters / "x", [adapters / "a", adapters / "b"], seed=40, xlora_depth=1)
    outside = tmp_path_factory.mktemp("outside")
    shutil.copytree(adapters / "c", outside / "c")
    shutil.copytree(adapters / "x", adapters / "x-out")
    config = json.loads((adapters / "x-out" / "adapter_config.json").read_text())
    config["adapters"] = {"0": str(adapters / "a"), "1": str(outside / "c")}
    (adapters / "x-out" / "adapter_config.json").write_text(json.dumps(config))

    r = load(server, "x", adapters / "x")
    assert r.status_code == 200, r.text
    got = client(server).completions.create(model="x", prompt=PROMPT, max_tokens=10, temperature=0)
    expected = lora_llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=10),
                                 lora=str(adapters / "x"))[0].outputs[0]
    assert got.choices[0].text == expected.text
    r = load(server, "x-out", adapters / "x-out")
    assert r.status_code == 403 and "mixes an adapter from, or links to, a path" in r.text
    assert unload(server, "x").status_code == 200
    assert client(server).completions.create(model=MODEL, prompt=PROMPT, max_tokens=2).choices[0].text is not None


FILES = ("adapter_config.json", "adapter_model.safetensors")


def _linked(adapters: Path, name: str, target: Path, link=Path.symlink_to) -> Path:
    """A folder inside --lora-dir whose files are links (`link`) to `target`'s."""
    folder = adapters / name
    folder.mkdir()
    for f in FILES:
        if link is Path.symlink_to:
            (folder / f).symlink_to(target / f)
        else:
            (folder / f).hardlink_to(target / f)
    return folder


def test_symlinked_files_cannot_lead_out(server: RunningServer, adapters: Path, tmp_path: Path) -> None:
    """Issue 33, item 4: a folder inside --lora-dir whose files are symlinks to files outside it is
    403 (each file is resolved, not only the folder); links that stay inside (a Hub cache's
    snapshot -> blob layout) load."""
    import shutil

    shutil.copytree(adapters / "b", tmp_path / "outside")
    r = load(server, "escape", _linked(adapters, "escape", tmp_path / "outside"))
    assert r.status_code == 403 and r.json()["error"]["code"] == "path_not_allowed", r.text
    assert "escape" not in server.engine.loras
    assert load(server, "inside", _linked(adapters, "inside", adapters / "b")).status_code == 200


def test_hard_links_are_the_operators_doing(server: RunningServer, adapters: Path, tmp_path: Path) -> None:
    """The policy is about paths: a hard link inside --lora-dir is a name there for the same file
    (it cannot be told from a copy), made by whoever may write there: it loads (docs/decisions.md)."""
    import shutil

    shutil.copytree(adapters / "b", tmp_path / "outside")
    assert load(server, "hard", _linked(adapters, "hard", tmp_path / "outside", Path.hardlink_to)).status_code == 200


def _swapping(server: RunningServer, monkeypatch: pytest.MonkeyPatch, swap, restore) -> list:
    """The engine's load wrapped: `swap()` after the server's path check and before the engine opens a
    file, `restore()` once the load is over. Returns the files the server checked and whether they
    resolve the same after the restore (what the server's own re-check would have seen)."""
    from ruvllm.server.adapters import _identities

    real_load, seen = server.engine.load_lora, []

    def swap_then_load(name: str, path: str, files):
        swap()
        try:
            return real_load(name, path, files)
        finally:
            restore()
            seen.append(_identities(Path(path)) == files)

    monkeypatch.setattr(server.engine, "load_lora", swap_then_load)
    return seen


def test_a_file_swapped_for_a_link_and_back_within_the_load_is_refused(
        server: RunningServer, adapters: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Between the check and the read, the weights become a symlink to a file outside, and are put
    back after the read: the engine opens the checked path without following a link, so the load is
    refused (403, naming the file) though everything resolves as checked again afterwards."""
    import shutil

    shutil.copytree(adapters / "b", tmp_path / "outside")
    shutil.copytree(adapters / "a", adapters / "swapped")
    weights = adapters / "swapped" / "adapter_model.safetensors"

    def swap():
        weights.rename(weights.with_suffix(".kept"))
        weights.symlink_to(tmp_path / "outside" / "adapter_model.safetensors")

    def restore():
        weights.unlink()
        weights.with_suffix(".kept").rename(weights)

    same_after = _swapping(server, monkeypatch, swap, restore)
    r = load(server, "swapped", adapters / "swapped")
    error = r.json()["error"]
    assert r.status_code == 403 and error["code"] == "path_not_allowed", r.text
    assert "adapter_model.safetensors: replaced by a symbolic link" in error["message"]
    assert same_after == [True] and "swapped" not in server.engine.loras
    monkeypatch.undo()
    assert load(server, "swapped", adapters / "swapped").status_code == 200  # as restored, it is allowed


def test_a_file_replaced_and_restored_within_the_load_is_refused(
        server: RunningServer, adapters: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The weights replaced by another regular file (an outside adapter's bytes copied in) during the
    load and put back after it: the descriptor read is not the inode checked, so 403."""
    import shutil

    shutil.copytree(adapters / "a", adapters / "replaced")
    weights = adapters / "replaced" / "adapter_model.safetensors"

    def swap():
        weights.rename(weights.with_suffix(".kept"))
        shutil.copyfile(adapters / "b" / "adapter_model.safetensors", weights)

    def restore():
        weights.with_suffix(".kept").replace(weights)

    same_after = _swapping(server, monkeypatch, swap, restore)
    r = load(server, "replaced", adapters / "replaced")
    assert r.status_code == 403 and r.json()["error"]["code"] == "path_not_allowed", r.text
    assert "another file than the one the path policy checked" in r.json()["error"]["message"]
    assert same_after == [True] and "replaced" not in server.engine.loras


def test_a_folder_swapped_for_a_link_within_the_load_is_refused(
        server: RunningServer, adapters: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A folder on the way (not the file: O_NOFOLLOW guards only the last component) swapped for a
    symlink to an outside folder during the load and back after it: the opened descriptor lies
    outside, which the engine sees on the descriptor itself (403 naming both paths)."""
    import shutil

    shutil.copytree(adapters / "a", adapters / "group" / "ad")
    shutil.copytree(adapters / "b", tmp_path / "outside" / "group" / "ad")
    group = adapters / "group"

    def swap():
        group.rename(adapters / "group.kept")
        group.symlink_to(tmp_path / "outside" / "group", target_is_directory=True)

    def restore():
        group.unlink()
        (adapters / "group.kept").rename(group)

    same_after = _swapping(server, monkeypatch, swap, restore)
    r = load(server, "group", group / "ad")
    message = r.json()["error"]["message"]
    assert r.status_code == 403 and r.json()["error"]["code"] == "path_not_allowed", r.text
    assert f"opened at {tmp_path / 'outside'}" in message and "a folder on the way was swapped" in message
    assert same_after == [True] and "group" not in server.engine.loras
