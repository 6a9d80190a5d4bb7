"""Tokenizers for both model formats, built by transformers from local files only."""

from __future__ import annotations

from pathlib import Path

from transformers import AutoTokenizer, PreTrainedTokenizerBase

from ruvllm.errors import ModelLoadError


def load_hf_tokenizer(folder: Path) -> PreTrainedTokenizerBase:
    try:
        # local_files_only: a model path must never turn into a Hub download.
        return AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ModelLoadError(f"{folder}: cannot load tokenizer ({type(e).__name__}: {e})") from None


def load_gguf_tokenizer(path: Path) -> PreTrainedTokenizerBase:
    try:
        # transformers rebuilds the tokenizer (and usually the chat template) from GGUF metadata.
        tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name, local_files_only=True)
    except (OSError, ValueError, KeyError, TypeError, NotImplementedError) as e:
        raise ModelLoadError(f"{path}: cannot build tokenizer from GGUF metadata ({type(e).__name__}: {e})") from None
    if not getattr(tok, "chat_template", None):
        from ruvllm.loader.gguf_file import open_reader  # lazy: only needed on this fallback path

        field = open_reader(path).get_field("tokenizer.chat_template")
        if field is not None:
            tok.chat_template = field.contents()
    return tok
