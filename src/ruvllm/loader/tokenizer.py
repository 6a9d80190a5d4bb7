"""Tokenizers for both model formats, built by transformers from local files only."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ruvllm.errors import ModelLoadError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

log = logging.getLogger(__name__)


def _one_line(e: BaseException) -> str:
    """transformers' tokenizer errors span several lines; CLI and HTTP errors are one."""
    return f"{type(e).__name__}: {' '.join(str(e).split())}"


def load_hf_tokenizer(folder: Path) -> PreTrainedTokenizerBase:
    try:
        # local_files_only: a model path must never turn into a Hub download.
        return _folder_class(folder).from_pretrained(str(folder), local_files_only=True)
    except Exception as e:  # the tokenizers library raises plain Exception on files it cannot parse
        raise ModelLoadError(f"{folder}: cannot load tokenizer ({_one_line(e)})") from None


def load_gguf_tokenizer(path: Path) -> PreTrainedTokenizerBase:
    """Built from GGUF metadata by transformers (the default model ~0.9 s of CPU, Gemma 3 ~7.5 s;
    session 21), then kept as a Hugging Face tokenizer folder in the model cache, which later loads
    read (medians of three, one process, session 28: the default model 0.23 s, Gemma 3's 33 MB
    tokenizer.json 4.0 s, against 0.49 and 6.3 s before _record_added_tokens). A cache that cannot
    be read in any way is rebuilt (the tokenizers library raises plain Exception on a bad file)."""
    ident = _identity(path)  # None: the file cannot be stat'ed, so nothing is cached for it
    cached = _cache_folder(ident) if ident is not None else None
    if cached is not None and (cached / "tokenizer.json").is_file():
        try:
            return _cached_class(cached).from_pretrained(str(cached), local_files_only=True)
        except Exception:  # noqa: BLE001
            log.warning("rebuilding unreadable tokenizer cache %s", cached)
            shutil.rmtree(cached, ignore_errors=True)
    try:
        # transformers rebuilds the tokenizer (and usually the chat template) from GGUF metadata.
        tok = _tokenizer_class(path).from_pretrained(str(path.parent), gguf_file=path.name, local_files_only=True)
    except Exception as e:  # transformers' GGUF conversion raises assorted types on metadata it cannot use
        raise ModelLoadError(f"{path}: cannot build tokenizer from GGUF metadata ({_one_line(e)})") from None
    if not getattr(tok, "chat_template", None):
        from ruvllm.loader.gguf_header import read_header  # lazy: only needed on this fallback path

        template = read_header(path).get("tokenizer.chat_template")
        if isinstance(template, str):
            tok.chat_template = template
    if ident is not None:
        _save(tok, ident)
    return tok


# Model types that register no tokenizer class of their own in transformers (or only its generic
# backend), and the class names a folder may give, for which AutoTokenizer builds transformers'
# generic backend: "PreTrainedTokenizerFast" is Llama 3's. Not qwen2, whose named class AutoTokenizer
# overrides (MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS), nor the families with a class of their own,
# nor other names (llama's "GPT2Tokenizer" gives GPT2Tokenizer; "LlamaTokenizerFast" depends on the
# tokenizer.json). tests/unit/test_loader.py checks each case against AutoTokenizer.
_GENERIC_TOKENIZER_TYPES = ("llama", "mistral")
_GENERIC_TOKENIZER_NAMES = ("TokenizersBackend", "PreTrainedTokenizerFast")


def _folder_class(folder: Path) -> Any:
    """AutoTokenizer's choice for a Hugging Face folder, made without importing AutoTokenizer where
    it is certain: the folder names transformers' generic backend, brings no tokenizer code of its
    own, and its config's model type registers no class (the two tuples above). AutoTokenizer
    imports torch (its config classes do), which `ruvllm serve` and `chat` fronts otherwise never
    load: 6.2 s of CPU for the tiny test model's tokenizer that way, 1.5 s directly (session 30)."""
    try:
        tokenizer_config = json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8"))
        model_type = json.loads((folder / "config.json").read_text(encoding="utf-8")).get("model_type")
        generic = ("auto_map" not in tokenizer_config and model_type in _GENERIC_TOKENIZER_TYPES
                   and tokenizer_config.get("tokenizer_class") in _GENERIC_TOKENIZER_NAMES)
    except (OSError, ValueError, AttributeError, TypeError):
        generic = False  # AutoTokenizer's own handling, and its error
    return _generic_backend() if generic else _auto_tokenizer()


def _auto_tokenizer() -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer


def _generic_backend() -> Any:
    from transformers.tokenization_utils_tokenizers import TokenizersBackend

    return TokenizersBackend


def _cached_class(folder: Path) -> Any:
    """The class that saved the cached folder, as AutoTokenizer would pick it from its
    tokenizer_config.json, imported directly where it is transformers' generic backend (every
    architecture without a class of its own, the default model's among them): importing AutoTokenizer
    makes transformers index every model family it has, 0.9 s of CPU in each process that loads a
    tokenizer (measured session 22, this host). Any other class is left to AutoTokenizer."""
    try:
        name = json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8")).get("tokenizer_class")
    except (OSError, ValueError, AttributeError):
        name = None  # AutoTokenizer's own error, and the rebuild, as before
    return _generic_backend() if name == "TokenizersBackend" else _auto_tokenizer()


def _tokenizer_class(path: Path) -> Any:
    """The class AutoTokenizer would pick, from the file's architecture alone.

    AutoTokenizer first builds the model's whole config from the file only to learn this class, and
    for the architectures without a fast config reader in transformers (llama and gemma3 among them)
    its legacy reader walks every metadata array item and tensor record through numpy: 7.4 s of the
    default model's 8.9 s of CPU, and most of Gemma 3's 38.5 s (262,144 tokens; measured session 21).
    The class follows from the model type, which is the GGUF architecture's name; AutoTokenizer stays
    the path for an architecture transformers does not know, or a folder whose tokenizer_config.json
    names a class of its own. tests/unit/test_loader.py checks both paths agree on the default model.
    """
    from transformers import AutoTokenizer
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
    from transformers.models.auto.tokenization_auto import TOKENIZER_MAPPING_NAMES, tokenizer_class_from_name
    from transformers.tokenization_utils_tokenizers import TokenizersBackend

    from ruvllm.loader.gguf_header import read_header  # lazy: the HF-folder path has no use for it

    architecture = read_header(path).get("general.architecture")
    if architecture not in CONFIG_MAPPING_NAMES or (path.parent / "tokenizer_config.json").exists():
        return AutoTokenizer
    # AutoTokenizer's own rule for a known model type: its registered class, else TokenizersBackend
    # (llama has none registered). Mistral's own backend has further rules: left to AutoTokenizer.
    name = TOKENIZER_MAPPING_NAMES.get(architecture)
    if name == "MistralCommonBackend":
        return AutoTokenizer
    return (tokenizer_class_from_name(name) if name else None) or TokenizersBackend


# What a cache folder holds: bumped when that changes, so a folder written before is converted anew.
# 2: tokenizer_config.json lists the added tokens (_record_added_tokens).
_FOLDER_FORMAT = 2


def _identity(path: Path) -> dict[str, Any] | None:
    """What names a GGUF file's cache folder: its resolved path, size and mtime (None: unreadable)."""
    try:
        st = path.stat()
    except OSError:
        return None
    return {"path": str(path.resolve()), "size": st.st_size, "mtime_ns": st.st_mtime_ns}


def _cache_folder(ident: dict[str, Any]) -> Path:
    """Keyed by the file's identity, the transformers version that converted it and the folder's format."""
    import transformers

    from ruvllm.loader.model_cache import resolve_cache_dir

    key = f"{ident['path']}|{ident['size']}|{ident['mtime_ns']}|{transformers.__version__}|{_FOLDER_FORMAT}"
    return resolve_cache_dir() / "tokenizers" / hashlib.sha256(key.encode()).hexdigest()[:32]


_SOURCE = "ruvllm-source.json"  # in each cache folder: the identity of the file it was converted from


def _save(tok: PreTrainedTokenizerBase, ident: dict[str, Any]) -> None:
    """Write the folder `ident` keys next to its place, then rename: a concurrent loader never sees
    half a folder. `ident` is recorded in it for _prune."""
    folder = _cache_folder(ident)
    try:
        folder.parent.mkdir(parents=True, exist_ok=True)
        _prune(folder.parent)
        tmp = Path(tempfile.mkdtemp(dir=folder.parent, prefix=".partial-"))
        tok.save_pretrained(str(tmp))
        _record_added_tokens(tmp)
        (tmp / _SOURCE).write_text(json.dumps(ident), encoding="utf-8")
        try:
            os.replace(tmp, folder)
        except OSError:  # another process got there first
            shutil.rmtree(tmp, ignore_errors=True)
    except OSError as e:  # a read-only or full cache only costs speed
        log.debug("tokenizer cache not written: %s", e)


def _prune(cache: Path) -> None:
    """Folders no load will read again: their file is gone or changed (a temporary file, a download
    replaced; the key is the file's identity), or they predate the source record. Without this the
    cache kept every file it ever saw (this machine's after many test runs: 40 folders, 194 MB).
    A folder of another transformers version whose file is unchanged stays: another environment may
    share the cache. Folders being written (".partial-") are left to their writers."""
    for entry in cache.iterdir():
        if entry.name.startswith("."):
            continue
        try:
            recorded = json.loads((entry / _SOURCE).read_text(encoding="utf-8"))
        except FileNotFoundError:  # written before the record was
            recorded = None
        except (OSError, ValueError):  # unreadable now (not a folder, no permission): left alone
            continue
        path = recorded.get("path") if isinstance(recorded, dict) else None
        if not isinstance(path, str) or _identity(Path(path)) != recorded:
            shutil.rmtree(entry, ignore_errors=True)


def _record_added_tokens(folder: Path) -> None:
    """The added tokens in tokenizer_config.json too, as `added_tokens_decoder` (transformers' key,
    which its version 5 reads first but saves only in tokenizer.json): without it every load parses
    the whole tokenizer.json in Python once more to find them (Gemma 3's 33 MB: its load 6.3 -> 4.0 s
    of CPU with this, load_gguf_tokenizer). The entries are tokenizer.json's own: the same tokens load."""
    config_path = folder / "tokenizer_config.json"
    config = json.loads(config_path.read_text(encoding="utf-8"))
    if "added_tokens_decoder" in config:
        return
    added = json.loads((folder / "tokenizer.json").read_text(encoding="utf-8")).get("added_tokens", [])
    config["added_tokens_decoder"] = {str(t["id"]): {k: v for k, v in t.items() if k != "id"} for t in added}
    config_path.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
