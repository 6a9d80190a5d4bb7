"""ruvllm: an LLM inference and serving engine in Python."""

from ruvllm.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from ruvllm.engine.async_engine import AsyncEngine
from ruvllm.engine.llm import LLM
from ruvllm.errors import (CorruptModelError, ModelLoadError, ModelNotFoundError, NotAModelError, RequestError,
                           RuvllmError, UnsupportedArchitectureError, UnsupportedQuantizationError)
from ruvllm.outputs import CompletionOutput, OutputKind, RequestOutput
from ruvllm.request import FinishReason, Priority
from ruvllm.sampling_params import SamplingParams

__version__ = "0.1.0"

__all__ = [
    "LLM", "AsyncEngine", "OutputKind", "SamplingParams", "Priority", "FinishReason", "RequestOutput", "CompletionOutput",
    "EngineConfig", "CacheConfig", "SchedulerConfig", "ModelConfig", "RuvllmError", "ModelLoadError",
    "ModelNotFoundError", "NotAModelError", "CorruptModelError", "UnsupportedArchitectureError",
    "UnsupportedQuantizationError", "RequestError", "__version__",
]
