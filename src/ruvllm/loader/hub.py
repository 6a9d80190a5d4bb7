"""Downloads through huggingface_hub into the local model cache (loader/model_cache.py).

`download MODEL` fetches a snapshot into the model's cache folder; `download MODEL:TAG` (or
`--quantization TAG`) makes a variant:
- a GGUF-only repository: the one .gguf file of that quantization (`pick_gguf`);
- a safetensors repository: int4 (round-to-nearest AWQ checkpoint), bf16 or f16 (dense copy),
  written from the plain download by a `Converter` the caller passes (ruvllm.cli.variants).
A download goes to `<folder>.partial` and is swapped in whole, marker last.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ruvllm.errors import ModelLoadError
from ruvllm.loader.model_cache import (
    MARKER_FILE,
    hub_id,
    is_current,
    model_dir,
    read_marker,
    resolve_cache_dir,
    split_tag,
)

__all__ = [
    "CONVERTED_TAGS",
    "Converter",
    "HubError",
    "ProgressHook",
    "download",
    "pick_gguf",
    "requested",
]


class HubError(ModelLoadError):
    """A download failed: unknown repository or revision, gated model, Hub unreachable, no usable files."""


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

# Variant tags (`--quantization`) with a file form on a safetensors checkpoint, written by a Converter.
CONVERTED_TAGS = ("int4", "bf16", "f16")
# Quantizations the engine applies to whatever it loads; no download stores them.
_LOAD_TIME_ONLY = ("auto", "none", "w8a8")
# What a tag picks in a GGUF-only repository: llama.cpp file types, best first. int8 is Q8_0
# because the engine keeps Q8_0 weights as int8.
_GGUF_TYPES: dict[str, tuple[str, ...]] = {
    "q8": ("Q8_0",),
    "int8": ("Q8_0",),
    "q4k": ("Q4_K_M", "Q4_K_S"),
    "int4": ("Q4_K_M", "Q4_0", "Q4_1"),
    "f16": ("F16", "FP16"),
    "bf16": ("BF16",),
}

# Writes the variant `tag` of the checkpoint folder (first argument) as a new folder at the second
# path (which does not exist yet); int4 in groups of the last argument (None: its default).
# Returns what to record in the variant's marker (e.g. group_size).
Converter = Callable[[Path, Path, str, int | None], dict[str, Any]]


def requested(model: str, quantization: str | None, *, gguf_file: str | None = None,
              group_size: int | None = None) -> tuple[str, str | None]:
    """(MODEL, tag) for `download MODEL[:TAG] [--quantization METHOD] [--gguf F] [--group-size N]`;
    ValueError, before anything is looked up, for options that contradict each other, a tag that is
    neither a quantization method nor a llama.cpp file type, or one no download stores."""
    base, tag = split_tag(model)
    asked = quantization.lower() if quantization is not None else None
    if tag is not None and asked is not None and tag != asked:
        raise ValueError(f"{model} names the variant :{tag} and --quantization asks for {asked}; give one")
    tag = tag or asked
    if tag is not None and tag not in _methods() and _gguf_file_type(tag) is None:
        raise ValueError(f"unknown quantization {tag!r}; choose one of {', '.join(_methods())}, "
                         "or a llama.cpp file type such as Q4_K_M (GGUF repositories)")
    if tag is not None and gguf_file is not None:
        raise ValueError("--gguf and --quantization both choose the file to download; give one of them")
    if group_size is not None and tag != "int4":
        raise ValueError("--group-size applies only with --quantization int4")
    if tag in _LOAD_TIME_ONLY:
        raise ValueError(_load_time_message(base, tag))
    return base, tag


def _methods() -> tuple[str, ...]:
    from ruvllm.config import QUANTIZATION_METHODS

    return tuple(dict.fromkeys((*QUANTIZATION_METHODS, *_GGUF_TYPES)))


def _gguf_file_type(tag: str) -> str | None:
    """The llama.cpp file type a tag spells (q5_k_m -> Q5_K_M), if it spells one."""
    import gguf

    names = {n.removeprefix("MOSTLY_") for n in gguf.LlamaFileType.__members__} - {"ALL_F32", "GUESSED"}
    return tag.upper() if tag.upper() in names | {"F32"} else None



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
    if _has_checkpoint(files):
        return _HF_PATTERNS
    ggufs = sorted(f for f in files if f.endswith(".gguf"))
    if len(ggufs) == 1:
        return ggufs
    if ggufs:
        shown = ", ".join(ggufs[:6]) + (", ..." if len(ggufs) > 6 else "")
        raise HubError(f"{name}: the repository holds {len(ggufs)} .gguf files; choose one with --gguf "
                       f"or --quantization ({shown})")
    raise HubError(f"{name}: the repository has no safetensors or GGUF weights (the formats ruvllm reads)")


def _has_checkpoint(files: list[str]) -> bool:
    return any(f.endswith(".safetensors") and not f.startswith(("consolidated", "original/")) for f in files)


def pick_gguf(name: str, files: list[str], tag: str) -> str:
    """The one .gguf file of a GGUF-only repository that `tag` asks for, by the llama.cpp file type
    in its name (any case, as Hub GGUF repositories spell them: model-Q4_K_M.gguf, model.q8_0.gguf);
    HubError, listing the repository's .gguf files, when none or several match."""
    ggufs = sorted(f for f in files if f.endswith(".gguf"))
    # Vision projectors (mmproj-*.gguf) share their file type with the model; they are no model.
    models = [f for f in ggufs if "mmproj" not in f.rsplit("/", 1)[-1].lower()]
    wanted = _GGUF_TYPES.get(tag) or ((_gguf_file_type(tag),) if _gguf_file_type(tag) else ())
    if not wanted:
        raise ValueError(f"{name}: --quantization {tag} names no GGUF file type")
    for file_type in wanted:
        hits = [f for f in models if _spells_type(f, file_type)]
        if len(hits) == 1:
            return hits[0]
        if hits:
            raise HubError(f"{name}: {len(hits)} .gguf files are {file_type} ({', '.join(hits)}); "
                           "choose one with --gguf")
    raise HubError(f"{name}: no .gguf file is {' or '.join(wanted)} (--quantization {tag}); "
                   f"the repository has: {', '.join(ggufs)}")


def _spells_type(file: str, file_type: str) -> bool:
    # Delimited on both sides, where `_` followed by more of a name continues it: Q4_0 must not
    # match Q4_0_4_4 nor Q6_K match Q6_K_L, and F16 must not match BF16.
    stem = file.rsplit("/", 1)[-1].lower().removesuffix(".gguf")
    return re.search(rf"(?<![a-z0-9]){re.escape(file_type.lower())}(?![a-z0-9]|_[a-z0-9])", stem) is not None


def _load_time_message(name: str, tag: str) -> str:
    return (f"{name}: --quantization {tag} is applied when the model is loaded, not stored by a download: "
            f"run `ruvllm download {name}`, then `ruvllm serve {name} -q {tag}`")


def download(
    model: str,
    revision: str | None = None,
    force: bool = False,
    cache_dir: str | os.PathLike[str] | None = None,
    *,
    gguf_file: str | None = None,
    quantization: str | None = None,
    group_size: int | None = None,
    convert: Converter | None = None,
    progress: ProgressHook | None = None,
) -> Path:
    """Download an alias or Hub id into the cache and return its folder.

    Already downloaded (at `revision`, if given) and not `force`: returns at once, no network.
    The snapshot goes to `<folder>.partial` first (a rerun resumes there) and replaces the folder
    only when complete, so a failed download never destroys a working copy.
    `quantization`, or a `:TAG` on `model`: the variant MODEL:TAG instead (see the module
    docstring). From a GGUF-only repository, the .gguf file of that quantization; from a
    safetensors one, the plain download (fetched first if missing) converted by `convert`, int4
    in groups of `group_size` (None: the converter's default; then an int4 variant of any group
    size counts as present). `force` rewrites a converted variant but keeps the plain download.
    `progress`: a ProgressHook (the CLI's draws rich bars); None shows nothing.
    """
    base, tag = requested(model, quantization, gguf_file=gguf_file, group_size=group_size)
    if tag is None:
        return _download_plain(base, revision, force, cache_dir, gguf_file, progress)
    return _download_variant(base, tag, revision, force, cache_dir, group_size, convert, progress)


def _download_plain(model: str, revision: str | None, force: bool, cache_dir: str | os.PathLike[str] | None,
                    gguf_file: str | None, progress: ProgressHook | None) -> Path:
    repo_id = hub_id(model)
    folder = model_dir(repo_id, cache_dir)
    if not force and is_current(folder, revision, gguf_file):
        return folder
    endpoint = _endpoint()
    with _hub_errors(model, repo_id, revision, endpoint):
        commit, files = _repo_files(model, repo_id, revision, endpoint)
        patterns = _patterns(model, files, gguf_file)
        _fetch(_Fetch(repo_id, revision, commit, endpoint, cache_dir, progress), folder, patterns,
               ignore=_HF_IGNORE if gguf_file is None else None, force=force)
    return folder


def _download_variant(model: str, tag: str, revision: str | None, force: bool,
                      cache_dir: str | os.PathLike[str] | None, group_size: int | None,
                      convert: Converter | None, progress: ProgressHook | None) -> Path:
    repo_id = hub_id(model)
    folder = model_dir(repo_id, cache_dir, tag)
    if not force and is_current(folder, revision, group_size=group_size):
        return folder
    plain = model_dir(repo_id, cache_dir)
    if (plain / "config.json").is_file() and is_current(plain, revision):
        return _convert(model, tag, plain, folder, group_size, convert)  # no network
    endpoint = _endpoint()
    with _hub_errors(model, repo_id, revision, endpoint):
        commit, files = _repo_files(model, repo_id, revision, endpoint)
        fetch = _Fetch(repo_id, revision, commit, endpoint, cache_dir, progress)
        if not _has_checkpoint(files):
            if group_size is not None:
                raise HubError(f"{model}: a GGUF repository; --group-size applies to safetensors checkpoints "
                               "(a GGUF file keeps its own groups)")
            file = pick_gguf(model, files, tag)
            _fetch(fetch, folder, [file], ignore=None, force=force, extra={"variant": tag, "note": f"GGUF file {file}"})
            return folder
        _check_convertible(model, tag, convert)  # before fetching a checkpoint that could not be converted
        _fetch(fetch, plain, _HF_PATTERNS, ignore=_HF_IGNORE, force=False)
    return _convert(model, tag, plain, folder, group_size, convert)


def _repo_files(model: str, repo_id: str, revision: str | None, endpoint: str | None) -> tuple[str, list[str]]:
    """The commit `revision` resolves to and the repository's files, in one model_info call (the
    commit is recorded in the marker; passing it to snapshot_download pins every file to it)."""
    from huggingface_hub import HfApi

    info = HfApi(endpoint=endpoint).model_info(repo_id, revision=revision)
    if not info.sha:
        raise HubError(f"{model}: the Hub gave no commit for revision {revision or 'main'!r}")
    return info.sha, [s.rfilename for s in info.siblings or ()]


def _check_convertible(model: str, tag: str, convert: Converter | None) -> None:
    if tag not in CONVERTED_TAGS:
        if tag in _methods():
            raise ValueError(_load_time_message(model, tag))
        raise ValueError(f"{model}: a safetensors repository has no {tag.upper()} file; variants of a safetensors "
                         f"model are written as {', '.join(CONVERTED_TAGS)}")
    if convert is None:
        raise ValueError(f"{model}:{tag} is converted from the checkpoint: pass a converter (ruvllm.cli.variants)")


def _convert(model: str, tag: str, plain: Path, folder: Path, group_size: int | None,
             convert: Converter | None) -> Path:
    """Write the variant from the plain download; its marker repeats the download's revision and commit."""
    _check_convertible(model, tag, convert)
    assert convert is not None
    source = read_marker(plain) or {}
    partial = folder.with_name(folder.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)  # a conversion cannot resume
    made = convert(plain, partial, tag, group_size)
    marker = {key: source.get(key) for key in ("repo_id", "revision", "commit", "endpoint")}
    marker.update(variant=tag, written_at=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), **made)
    (partial / MARKER_FILE).write_text(json.dumps(marker, indent=2) + "\n", encoding="utf-8")
    _swap_in(partial, folder)
    return folder


@dataclass(frozen=True)
class _Fetch:
    """Where one download comes from and how it is shown."""

    repo_id: str
    revision: str | None
    commit: str
    endpoint: str | None
    cache_dir: str | os.PathLike[str] | None
    progress: ProgressHook | None


def _fetch(fetch: _Fetch, folder: Path, patterns: list[str], *, ignore: list[str] | None, force: bool,
           extra: dict[str, Any] | None = None) -> None:
    """Snapshot the files matching `patterns` into `folder` (see `download`), marker last."""
    from huggingface_hub import snapshot_download

    partial = folder.with_name(folder.name + ".partial")
    if force:
        shutil.rmtree(partial, ignore_errors=True)
    _reset_partial_if_other(partial, f"{fetch.commit} {' '.join(patterns)}")
    with (fetch.progress or _silent)(fetch.repo_id) as bar_class:
        snapshot_download(
            fetch.repo_id,
            revision=fetch.commit,
            local_dir=partial,
            # huggingface_hub keeps refs/locks in cache_dir even for local_dir downloads:
            # keep them inside our cache rather than in ~/.cache/huggingface.
            cache_dir=resolve_cache_dir(fetch.cache_dir) / ".hf",
            allow_patterns=patterns,
            ignore_patterns=ignore,
            endpoint=fetch.endpoint,
            force_download=force,
            tqdm_class=bar_class,
            max_workers=4,
        )
    marker = {
        "repo_id": fetch.repo_id,
        "revision": fetch.revision or "main",
        "commit": fetch.commit,
        "endpoint": fetch.endpoint or "https://huggingface.co",
        "downloaded_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        **(extra or {}),
    }
    (partial / MARKER_FILE).write_text(json.dumps(marker, indent=2) + "\n", encoding="utf-8")
    _swap_in(partial, folder)


def _reset_partial_if_other(partial: Path, stamp_text: str) -> None:
    """Resume an interrupted download only of the same commit and files; others' files would linger
    (a second .gguf beside the one asked for makes the folder unreadable)."""
    stamp = partial / ".ruvllm-partial-commit"
    try:
        previous = stamp.read_text(encoding="utf-8").strip()
    except OSError:
        previous = None
    if previous != stamp_text:
        shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True, exist_ok=True)
    stamp.write_text(stamp_text + "\n", encoding="utf-8")


def _swap_in(new: Path, folder: Path) -> None:
    """Replace `folder` by `new` (two renames; the old copy is deleted only after the swap)."""
    old = folder.with_name(f"{folder.name}.old-{os.getpid()}")
    if folder.exists():
        folder.rename(old)
    new.rename(folder)
    shutil.rmtree(old, ignore_errors=True)


# A download reports its progress through a hook: given the repository id, a context manager that
# yields a tqdm-like class for snapshot_download (the CLI's draws rich bars: cli/download_progress.py).
ProgressHook = Callable[[str], AbstractContextManager[type]]


class TqdmBar:
    """The parts of tqdm that huggingface_hub's snapshot_download calls, for a hook's bar class to
    subclass: it says what a bar shows when it starts (`started`), when its total is learnt
    (`total_changed`) and at each update (`advanced`, under the bar's lock: updates come from the
    download's threads)."""

    def __init__(self, *_args: Any, total: float | None = None, initial: float = 0, desc: str | None = None,
                 unit: str = "it", **_ignored: Any) -> None:
        self.n, self._total, self.desc, self.unit = initial, total, desc or "", unit
        self._lock = threading.Lock()
        self.format_dict: dict[str, Any] = {"rate": None}  # read for a speed postfix only
        self.started()

    @property
    def total(self) -> float | None:
        return self._total

    @total.setter
    def total(self, value: float | None) -> None:
        self._total = value
        self.total_changed(value)

    @property
    def repeats_bytes(self) -> bool:
        """The "received bytes" bar repeats the "written bytes" one for plain HTTP: show one."""
        return self.desc.startswith("Downloading bytes")

    def update(self, n: float | None = 1) -> None:
        with self._lock:
            self.n += n or 0
            self.advanced(n or 0)

    def started(self) -> None: ...
    def total_changed(self, value: float | None) -> None: ...
    def advanced(self, n: float) -> None: ...
    def refresh(self, *_a: Any, **_k: Any) -> None: ...
    def close(self) -> None: ...
    def set_description(self, *_a: Any, **_k: Any) -> None: ...
    def set_description_str(self, *_a: Any, **_k: Any) -> None: ...
    def set_postfix_str(self, *_a: Any, **_k: Any) -> None: ...
    def set_postfix(self, *_a: Any, **_k: Any) -> None: ...

    def __enter__(self) -> TqdmBar:
        return self

    def __exit__(self, *_exc: Any) -> None:
        return None


@contextmanager
def _silent(_repo_id: str) -> Iterator[type]:
    from huggingface_hub.utils import tqdm as hf_tqdm

    class _Quiet(hf_tqdm):  # type: ignore[misc, valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            kwargs["disable"] = True
            super().__init__(*args, **kwargs)

    yield _Quiet

