"""The stream path's two shortcuts write exactly what the plain code writes: the detokenizer's direct
call into the tokenizer's Rust backend (engine/detokenizer.py::ids_decoder) against the tokenizer's
own decode, and an SSE frame with its fixed fields encoded once (server/responses.py::sse_frames)
against `sse` of the whole chunk."""

from __future__ import annotations

import random

import pytest

from ruvllm.engine.detokenizer import ids_decoder
from ruvllm.loader import load_tokenizer, resolve_model
from ruvllm.server.responses import sse, sse_frames


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(resolve_model(None))


@pytest.mark.parametrize("skip", [False, True])
def test_the_direct_decode_equals_the_tokenizers_own(tok, skip: bool) -> None:
    rng = random.Random(7)
    decode = ids_decoder(tok, skip)
    special = list(tok.all_special_ids)
    for _ in range(2000):
        ids = [rng.randrange(len(tok)) for _ in range(rng.randrange(0, 12))]
        if rng.random() < 0.3 and special:  # special tokens, which skip_special_tokens drops
            ids.insert(rng.randrange(len(ids) + 1), rng.choice(special))
        assert decode(ids) == tok.decode(ids, skip_special_tokens=skip), ids


def test_a_frame_equals_the_whole_chunk_encoded() -> None:
    rng = random.Random(11)
    texts = ["", "a", "é\"\\\n", "日本 😀", "\x00choices\x00", "</s>", "{\"x\": 1}"]
    for _ in range(500):
        before = {"id": f"cmpl-{rng.randrange(10**9)}", "object": "text_completion", "created": rng.randrange(10**10),
                  "model": rng.choice(texts)}
        after = rng.choice([{}, {"usage": None}, {"system_fingerprint": rng.choice(texts)}])
        frame = sse_frames(before, after)
        for _ in range(3):
            choices = [{"index": rng.randrange(4), "text": rng.choice(texts) + rng.choice(texts),
                        "logprobs": None, "finish_reason": rng.choice([None, "stop", "length"])}]
            assert frame(choices) == sse({**before, "choices": choices, **after})
    # a field named like the slot, or "choices" among the fixed fields, takes the plain path
    assert sse_frames({"choices": 1}, {})([]) == sse({"choices": []})
