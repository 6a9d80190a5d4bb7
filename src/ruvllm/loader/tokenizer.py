"""Tokenizers for both model formats, built by transformers from local files only."""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import tempfile
from pathlib import Path

from transformers import AutoTokenizer, PreTrainedTokenizerBase

from ruvllm.errors import ModelLoadError

log = logging.getLogger(__name__)


def _one_line(e: BaseException) -> str:
    """transformers' tokenizer errors span several lines; CLI and HTTP errors are one."""
    return f"{type(e).__name__}: {' '.join(str(e).split())}"


def load_hf_tokenizer(folder: Path) -> PreTrainedTokenizerBase:
    try:
        # local_files_only: a model path must never turn into a Hub download.
        return AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    except Exception as e:  # the tokenizers library raises plain Exception on files it cannot parse
        raise ModelLoadError(f"{folder}: cannot load tokenizer ({_one_line(e)})") from None


def load_gguf_tokenizer(path: Path) -> PreTrainedTokenizerBase:
    """Built from GGUF metadata by transformers (~5-7 s: it parses the whole vocabulary), then kept as
    a Hugging Face tokenizer folder in the model cache, so later loads of the same file take ~0.2 s."""
    cached = _cache_folder(path)
    if cached is not None and (cached / "tokenizer.json").is_file():
        try:
            return AutoTokenizer.from_pretrained(str(cached), local_files_only=True)
        except (OSError, ValueError, KeyError, TypeError):
            log.warning("rebuilding unreadable tokenizer cache %s", cached)
            shutil.rmtree(cached, ignore_errors=True)
    try:
        # transformers rebuilds the tokenizer (and usually the chat template) from GGUF metadata.
        tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name, local_files_only=True)
    except Exception as e:  # transformers' GGUF conversion raises assorted types on metadata it cannot use
        raise ModelLoadError(f"{path}: cannot build tokenizer from GGUF metadata ({_one_line(e)})") from None
    if not getattr(tok, "chat_template", None):
        from ruvllm.loader.gguf_header import read_header  # lazy: only needed on this fallback path

        template = read_header(path).get("tokenizer.chat_template")
        if isinstance(template, str):
            tok.chat_template = template
    if cached is not None:
        _save(tok, cached)
    return tok


def _cache_folder(path: Path) -> Path | None:
    """Keyed by the file's identity (path, size, mtime) and the transformers version that converted it."""
    import transformers

    from ruvllm.loader.model_cache import resolve_cache_dir
    try:
        st = path.stat()
    except OSError:
        return None
    key = f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}|{transformers.__version__}"
    return resolve_cache_dir() / "tokenizers" / hashlib.sha256(key.encode()).hexdigest()[:32]


def _save(tok: PreTrainedTokenizerBase, folder: Path) -> None:
    """Write next to the target, then rename: a concurrent loader never sees half a folder."""
    try:
        folder.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=folder.parent, prefix=".partial-"))
        tok.save_pretrained(str(tmp))
        try:
            os.replace(tmp, folder)
        except OSError:  # another process got there first
            shutil.rmtree(tmp, ignore_errors=True)
    except OSError as e:  # a read-only or full cache only costs speed
        log.debug("tokenizer cache not written: %s", e)
