"""Rerank and score request bodies (server/rerank.py's routes): the fields vLLM's, Jina's and Cohere's
clients share. Unknown fields are ignored (extra="allow"): each client adds its own."""

from __future__ import annotations

from typing import Literal, Union

from pydantic import BaseModel, ConfigDict, StrictBool, StrictInt, StrictStr


class RerankDocument(BaseModel):
    """A document as an object (Cohere's v1 and Jina's clients send these): its `text`; other fields ride along."""

    model_config = ConfigDict(extra="allow")
    text: StrictStr


class RerankRequest(BaseModel):
    """vLLM's, Jina's and Cohere's body (the fields they share). Unknown fields are ignored."""

    model_config = ConfigDict(extra="allow")
    model: str | None = None
    query: StrictStr
    documents: list[Union[StrictStr, RerankDocument]]
    top_n: StrictInt | None = None  # None: every document
    return_documents: StrictBool = True  # as vLLM and Jina; Cohere's clients say false
    instruction: StrictStr | None = None  # what "relevant" means here (vLLM's field); None: DEFAULT_INSTRUCTION
    user: str | None = None
    priority: Literal["low", "normal", "high", "critical"] | None = None  # ruvllm's, as on completions


class ScoreRequest(BaseModel):
    """vLLM's score body: each side a text or a list of texts (1:1, 1:N or N:N pairs)."""

    model_config = ConfigDict(extra="allow")
    model: str | None = None
    text_1: Union[StrictStr, list[StrictStr]]
    text_2: Union[StrictStr, list[StrictStr]]
    instruction: StrictStr | None = None
    user: str | None = None
    priority: Literal["low", "normal", "high", "critical"] | None = None
