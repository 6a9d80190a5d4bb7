"""transformers' own GGUF loader, as the tests' independent references read a model file.

Two of its costs are spent on nothing the model is made of, and are cut here without touching what
it reads or how:
- the tokenizer's arrays, which its reader parses string by string: it reads a copy without them
  (tests/gguf_copy.py);
- gguf's table of tensor names (`get_tensor_name_map(arch, n_blocks)`, every known name pattern
  expanded for every block), which transformers builds again for each module of the model as it
  walks the tree to map names: 397 times for the default model, 313 for Gemma 3, 7.9 and 3.8 s of
  the loads' 9.3 and 7.1 s of CPU (docs/benchmarks.md, "Suite time, session 17"). The table is a
  pure function of its two arguments, so for the load it is built once per pair and handed back."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import torch


def hf_model_from_gguf(src: Path, folder: Path, **kwargs: Any) -> torch.nn.Module:
    """`AutoModelForCausalLM.from_pretrained(gguf_file=...)` on a copy of `src` written into `folder`."""
    import gguf
    from transformers import AutoModelForCausalLM

    from tests.gguf_copy import without_vocabulary

    copy = without_vocabulary(src, folder / src.name)
    built = gguf.get_tensor_name_map
    # transformers imports the function from the package at each call, so the package's name is the one to swap
    gguf.get_tensor_name_map = functools.lru_cache(maxsize=None)(built)
    try:
        return AutoModelForCausalLM.from_pretrained(str(copy.parent), gguf_file=copy.name, **kwargs)
    finally:
        gguf.get_tensor_name_map = built
