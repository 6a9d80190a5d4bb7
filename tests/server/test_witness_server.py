"""The server records every completion in the witness log (the real `openai` client; streamed,
n > 1, several prompts), and the chain verifies; with a key file, against the head it signs."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from ruvllm import LLM
from ruvllm.witness.log import find, head_path, read_key, token_hash, verify
from tests.server.conftest import MODEL, RunningServer, start_server


@pytest.fixture
def server(_shared_llm: LLM, tmp_path: Path) -> Iterator[RunningServer]:
    (tmp_path / "key").write_bytes(b"the witness key")
    yield from start_server(_shared_llm, witness_log=str(tmp_path / "w.sqlite3"), witness_store_tokens=True,
                            witness_key_file=str(tmp_path / "key"))


def test_every_completion_is_witnessed(server: RunningServer) -> None:
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=6,
                                          temperature=0.5, seed=3)
    many = client.completions.create(model=MODEL, prompt=["one two", "three"], max_tokens=4, n=2, temperature=0.8)
    chunks = list(client.completions.create(model=MODEL, prompt="a b c", max_tokens=5, stream=True,
                                                 stream_options={"include_usage": True}))
    server.wait_idle()
    app_state = server.app.state.ruvllm
    app_state.service.witness.flush()
    path = Path(server.cfg.witness_log)
    assert verify(path).ok and verify(path).entries == 4  # chat, two prompts, the stream
    assert head_path(path).is_file()
    v = verify(path, read_key(server.cfg.witness_key_file))
    assert v.ok and v.tail.startswith("matches the signed head of ") and v.tail.endswith(" (4 entries)")
    (entry,) = find(path, chat.id)
    body = entry.body
    assert entry.kind == "completion" and entry.tenant == "default"
    assert body["model"] == MODEL and body["model_digest"].startswith(("sha256:", "name:"))
    assert body["params"]["temperature"] == 0.5 and body["params"]["seed"] == 3
    out = body["outputs"][0]
    assert out["tokens"] == chat.usage.completion_tokens and out["hash"] == token_hash(out["token_ids"])
    assert body["prompt_tokens"] == chat.usage.prompt_tokens and body["prompt_hash"] == token_hash(body["prompt_ids"])
    entries = find(path, many.id)
    assert sorted(e.body["prompt_index"] for e in entries) == [0, 1] and all(len(e.body["outputs"]) == 2 for e in entries)
    (streamed,) = find(path, chunks[0].id)
    assert streamed.body["outputs"][0]["tokens"] == chunks[-1].usage.completion_tokens > 0
