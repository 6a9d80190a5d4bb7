"""Typed exceptions. Inside the engine we raise these; the edges (HTTP, CLI) turn them into messages."""

from __future__ import annotations


class RuvllmError(Exception):
    """Base class of every error ruvllm raises on purpose."""


class ModelLoadError(RuvllmError):
    """A model could not be loaded; the message names the file and the problem."""


class ModelNotFoundError(ModelLoadError):
    """The path given as a model does not exist."""


class NotAModelError(ModelLoadError):
    """The path exists but holds no model ruvllm can read (no config.json/safetensors, not GGUF)."""


class CorruptModelError(ModelLoadError):
    """A model file is truncated or its contents are inconsistent."""


class UnsupportedArchitectureError(ModelLoadError):
    """The model's architecture is not one ruvllm implements."""


class UnsupportedQuantizationError(ModelLoadError):
    """A tensor uses a quantization type ruvllm cannot read."""


class EngineShutdownError(RuvllmError):
    """The request was aborted because the engine is shutting down."""


class EngineDeadError(RuvllmError):
    """The engine loop failed and stopped: this request, and every later one, cannot be served."""


class ReplicaLostError(RuvllmError):
    """The data-parallel replica serving this request failed; the others serve on, and the same
    request sent again goes to one of them (HTTP 503)."""


class RequestError(RuvllmError, ValueError):
    """A request cannot be served as asked (prompt too long, bad token ids, ...).

    `param` names the request field at fault (as the OpenAI API's error `param`), when one is."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class AdapterError(RuvllmError, ValueError):
    """A LoRA adapter cannot be loaded or used: the message names the file and the problem."""


class AdapterPathError(AdapterError):
    """An adapter file is not the one the server's path policy checked (swapped, or a link put in its
    place, since the check): not read (HTTP 403 at the server)."""


class AdapterCapacityError(AdapterError):
    """The engine holds as many adapters as it keeps (--max-cpu-loras): one must be unloaded first."""


class AdapterNotFoundError(RequestError):
    """A request names an adapter that is not loaded (HTTP 404 at the server)."""
