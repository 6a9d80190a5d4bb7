"""Weights functions for tensor-parallel tests, in a module of their own: a rank process unpickles
them, importing this module, which must stay light (the test modules import transformers)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ruvllm.config import ModelConfig

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class LoadsInOwnerOnly:
    """`cfg`'s random weights in the process `owner` only: every other rank's load fails."""

    cfg: ModelConfig
    owner: int

    def __call__(self, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
        if os.getpid() != self.owner:
            raise OSError("the disk went away (injected)")
        from ruvllm.models.random_weights import random_weights

        return random_weights(self.cfg, dtype, "cpu", std=0.1)
