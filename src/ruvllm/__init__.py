"""ruvllm: an LLM inference and serving engine in Python.

The names below load on first use (PEP 562), so importing one part (the engine core in its own
process, the CLI's help) does not import every other part and torch with it."""

from __future__ import annotations

import importlib
import os
import platform
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# A request's rows must not depend on what shares its step. bf16/fp16 matmuls on the CPU are
# oneDNN's, and on CPUs with AMX (Sapphire Rapids) its AMX kernels block a call of a few rows
# differently from a call of many: a bf16 row's bits changed with the row count (measured on every
# projection shape of the default model, tests/unit/test_dense_linear.py). Capped at AVX-512 BF16,
# as on CPUs without AMX, the rows are the same at every count. Read by oneDNN at its first use, so
# set before torch runs anything; a user's own setting is kept.
if platform.machine().lower() in ("x86_64", "amd64"):
    os.environ.setdefault("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_BF16")

_EXPORTS = {
    "LLM": "ruvllm.engine.llm", "AsyncEngine": "ruvllm.engine.async_engine", "OutputKind": "ruvllm.outputs",
    "SamplingParams": "ruvllm.sampling_params", "Priority": "ruvllm.request", "FinishReason": "ruvllm.request",
    "RequestOutput": "ruvllm.outputs", "CompletionOutput": "ruvllm.outputs", "EngineConfig": "ruvllm.config",
    "CacheConfig": "ruvllm.config", "SchedulerConfig": "ruvllm.config", "ModelConfig": "ruvllm.config",
    "EngineInfo": "ruvllm.messages", "EngineStats": "ruvllm.messages",
    **{name: "ruvllm.errors" for name in (
        "RuvllmError", "ModelLoadError", "ModelNotFoundError", "NotAModelError", "CorruptModelError",
        "UnsupportedArchitectureError", "UnsupportedQuantizationError", "RequestError", "EngineDeadError",
        "EngineShutdownError")},
}

__all__ = [*_EXPORTS, "__version__"]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'ruvllm' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


if TYPE_CHECKING:
    from ruvllm.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
    from ruvllm.engine.async_engine import AsyncEngine
    from ruvllm.engine.llm import LLM
    from ruvllm.errors import (CorruptModelError, EngineDeadError, EngineShutdownError, ModelLoadError,
                               ModelNotFoundError, NotAModelError, RequestError, RuvllmError,
                               UnsupportedArchitectureError, UnsupportedQuantizationError)
    from ruvllm.messages import EngineInfo, EngineStats
    from ruvllm.outputs import CompletionOutput, OutputKind, RequestOutput
    from ruvllm.request import FinishReason, Priority
    from ruvllm.sampling_params import SamplingParams
