"""What one witness entry holds, for each kind of event."""

from __future__ import annotations

import hashlib
from dataclasses import asdict
from pathlib import Path
from typing import Any

from ruvllm.sampling_params import SamplingParams
from ruvllm.witness.log import token_hash


def model_digest(path: str) -> str:
    """SHA-256 of the model's bytes: a file's, or a folder's weights, config and tokenizer files
    (each file's digest with its name, in name order). A name that is no path (a model built in
    memory) is digested as the name."""
    p = Path(path)
    if p.is_file():
        return "sha256:" + _file_digest(p)
    if p.is_dir():
        h = hashlib.sha256()
        for f in sorted(q for q in p.rglob("*") if q.is_file() and q.suffix in (".safetensors", ".json", ".gguf",
                                                                                  ".model", ".txt")):
            h.update(f"{f.relative_to(p)}\0{_file_digest(f)}\n".encode())
        return "sha256:" + h.hexdigest()
    return "name:" + path


def _file_digest(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def completion_record(model: str, adapter: str | None, params: SamplingParams, prompt_ids: list[int],
                      choices: list[tuple[list[int], str | None]], store_tokens: bool, index: int = 0) -> dict[str, Any]:
    """A completion: the adapter (and version) it ran with, its sampling parameters, and hashes of
    its prompt and of each choice's output tokens (the tokens too with store_tokens)."""
    body: dict[str, Any] = {
        "model": model, "adapter": adapter, "prompt_index": index,
        "params": {k: v for k, v in asdict(params).items() if v is not None and not k.startswith("_")},
        "prompt_tokens": len(prompt_ids), "prompt_hash": token_hash(prompt_ids),
        "outputs": [{"tokens": len(ids), "hash": token_hash(ids), "finish_reason": reason} for ids, reason in choices],
    }
    if store_tokens:
        body["prompt_ids"] = list(prompt_ids)
        for out, (ids, _) in zip(body["outputs"], choices):
            out["token_ids"] = list(ids)
    return body
