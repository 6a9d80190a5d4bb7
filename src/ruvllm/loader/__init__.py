"""Model loading (source.py: resolve a path, read its config, stream its weights, build its
tokenizer), the model cache (model_cache.py) and downloads (hub.py).

Names are imported on first use (PEP 562): the model cache and the CLI's commands must not pay for
torch and transformers, which reading weights and tokenizers needs.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_FROM_SOURCE = ("ModelSource", "check_model", "default_model_path", "iter_weights", "load_model_config",
                "load_tokenizer", "resolve_model")
__all__ = list(_FROM_SOURCE)


def __getattr__(name: str) -> Any:
    if name not in _FROM_SOURCE:
        raise AttributeError(f"module 'ruvllm.loader' has no attribute {name!r}")
    value = getattr(importlib.import_module("ruvllm.loader.source"), name)
    globals()[name] = value
    return value


if TYPE_CHECKING:
    from ruvllm.loader.source import (ModelSource, check_model, default_model_path, iter_weights,
                                      load_model_config, load_tokenizer, resolve_model)
