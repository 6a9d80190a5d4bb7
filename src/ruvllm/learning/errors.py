"""The learner's typed errors (a module of their own, light, so the server maps them to HTTP without
loading the learner)."""

from __future__ import annotations

from ruvllm.errors import RequestError, RuvllmError


class FeedbackError(RequestError):
    """Feedback refused for what it says (a score out of range, an empty correction); `param` names the field."""


class CompletionNotFoundError(FeedbackError):
    """Feedback on no completion of the tenant's: unknown, expired, or another tenant's."""


class UpdateNotServedError(RuvllmError):
    """The update was learned but the engine could not take its adapter version (no room for another)."""
