"""The engine's side of the adapter path policy (lora/checked_files.py): a file is read only from a
descriptor that is the file the server's check saw (server/adapters.py's `_identities`), with the
kernel's word on where the descriptor lies and, where the system gives none, by device and inode
alone. Each swap is made between the check and the read, as a racing writer would."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from ruvllm.errors import AdapterPathError
from ruvllm.lora import checked_files
from ruvllm.lora.checked_files import read_file
from ruvllm.server.adapters import _identities

FILES = ("adapter_config.json", "adapter_model.safetensors")


@pytest.fixture(params=["kernel path", "device and inode only"])
def where(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Both ways the engine can tell what it opened: with /proc (or F_GETPATH), and without."""
    if request.param != "kernel path":
        monkeypatch.setattr(checked_files, "descriptor_path", lambda fd: None)
    return request.param


def _folder(root: Path, name: str, text: str) -> Path:
    folder = root / name
    folder.mkdir(parents=True)
    for f in FILES:
        (folder / f).write_text(f"{text} {f}")
    return folder


def test_the_kernel_names_the_opened_file(tmp_path: Path) -> None:
    """Where /proc is there (this suite's Linux), the descriptor's path is the file's resolved path."""
    f = _folder(tmp_path, "a", "inside") / FILES[0]
    with open(f, "rb") as fh:
        assert checked_files.descriptor_path(fh.fileno()) == str(f.resolve())


def test_an_unchanged_adapter_reads(tmp_path: Path, where: str) -> None:
    folder = _folder(tmp_path, "a", "inside")
    checked = _identities(folder)
    assert read_file(folder / FILES[1], checked) == b"inside adapter_model.safetensors"


def test_a_folder_on_the_way_swapped_for_a_link_is_not_read(tmp_path: Path, where: str) -> None:
    folder = _folder(tmp_path / "lora" / "group", "ad", "inside")
    _folder(tmp_path / "outside" / "group", "ad", "outside")
    checked = _identities(folder)
    (tmp_path / "lora" / "group").rename(tmp_path / "lora" / "kept")
    (tmp_path / "lora" / "group").symlink_to(tmp_path / "outside" / "group", target_is_directory=True)
    with pytest.raises(AdapterPathError, match="a folder on the way was swapped" if where == "kernel path"
                       else "another file than the one the path policy checked"):
        read_file(folder / FILES[0], checked)


def test_a_file_replaced_is_not_read(tmp_path: Path, where: str) -> None:
    folder = _folder(tmp_path, "a", "inside")
    outside = _folder(tmp_path, "outside", "outside")
    checked = _identities(folder)
    (folder / FILES[1]).rename(tmp_path / "kept")
    shutil.copyfile(outside / FILES[1], folder / FILES[1])
    with pytest.raises(AdapterPathError, match="another file than the one the path policy checked"):
        read_file(folder / FILES[1], checked)
    (tmp_path / "kept").replace(folder / FILES[1])  # put back: read again, it is the checked file
    assert read_file(folder / FILES[1], checked) == b"inside adapter_model.safetensors"


def test_a_link_put_at_the_checked_path_is_not_followed(tmp_path: Path, where: str) -> None:
    folder = _folder(tmp_path, "a", "inside")
    outside = _folder(tmp_path, "outside", "outside")
    checked = _identities(folder)
    (folder / FILES[0]).unlink()
    (folder / FILES[0]).symlink_to(outside / FILES[0])
    with pytest.raises(AdapterPathError, match="replaced by a symbolic link"):
        read_file(folder / FILES[0], checked)


def test_a_file_the_check_did_not_see_is_not_read(tmp_path: Path, where: str) -> None:
    folder = _folder(tmp_path, "a", "inside")
    checked = _identities(folder)
    (folder / "adapter_model.bin").write_bytes(b"x")
    with pytest.raises(AdapterPathError, match="not among the files the path policy checked"):
        read_file(folder / "adapter_model.bin", checked)
    (folder / "3").mkdir()  # an X-LoRA sub-folder's file made after the check: absent then
    (folder / "3" / FILES[1]).write_bytes(b"x")
    with pytest.raises(AdapterPathError):
        read_file(folder / "3" / FILES[1], checked)


def test_without_a_check_the_resolved_path_is_read(tmp_path: Path) -> None:
    """Adapters named at start-up and learned ones: no policy, read through what the path resolves to."""
    folder = _folder(tmp_path, "a", "inside")
    (tmp_path / "link").symlink_to(folder / FILES[0])
    assert read_file(tmp_path / "link") == b"inside adapter_config.json"
