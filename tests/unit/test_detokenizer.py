"""IncrementalDetokenizer with the embedded model's real tokenizer: multi-byte text, stop strings."""

from __future__ import annotations

import pytest

from ruvllm.engine.detokenizer import IncrementalDetokenizer
from ruvllm.loader import load_tokenizer, resolve_model

TEXTS = [
    "café 日本語 😀 naïve",
    "👨‍👩‍👧‍👦🇫🇷 🙂 👍🏽 done",
    "Hello , world . ok ?",
    "Ünïcödé — “quotes” … ½ ∑ 𝔘𝔫𝔦 ← → ✓",
    "  two  spaces\nnew line\ttab 中文字符测试 한국어 العربية",
]


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(resolve_model(None))


def enc(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def feed(tok, ids: list[int], prompt: list[int] | None = None, **kw) -> tuple[IncrementalDetokenizer, list]:
    d = IncrementalDetokenizer(tok, prompt if prompt is not None else enc(tok, "Say:"), **kw)
    results = []
    for t in ids:  # the engine finishes the request at the first stop string
        results.append(d.add(t))
        if results[-1] is not None:
            break
    return d, results


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("prompt", ["Say:", "", "日本"])
def test_one_token_at_a_time_equals_full_decode(tok, text: str, prompt: str) -> None:
    ids = enc(tok, text)
    expected = tok.decode(ids, skip_special_tokens=True)
    assert expected == text
    d = IncrementalDetokenizer(tok, enc(tok, prompt))
    for t in ids:
        assert d.add(t) is None
        assert "\ufffd" not in d.text
        assert expected.startswith(d.text)
    assert d.text == expected


def test_multibyte_characters_are_split_across_tokens(tok) -> None:
    """Guard: the texts above really exercise the incomplete-character path."""
    ids = enc(tok, TEXTS[0]) + enc(tok, TEXTS[1])
    assert any("\ufffd" in tok.decode([t]) for t in ids)


def test_special_tokens_skipped(tok) -> None:
    ids = enc(tok, "hi there") + [tok.eos_token_id]
    d, _ = feed(tok, ids)
    assert d.text == "hi there"
    d, _ = feed(tok, ids, skip_special_tokens=False)
    assert d.text == tok.decode(ids, skip_special_tokens=False)


def test_stop_string_across_token_boundaries(tok) -> None:
    text = "Hello , world . ok ?"
    ids = enc(tok, text)
    assert [tok.decode([t]) for t in ids] == ["Hello", " ,", " world", " .", " ok", " ?"]
    d, res = feed(tok, ids[:3], stop_strings=("lo , wo",))  # spans three tokens
    assert res == [None, None, "lo , wo"]
    assert d.text == "Hel"
    d, res = feed(tok, ids[:3], stop_strings=("lo , wo",), include_stop_str=True)
    assert res[-1] == "lo , wo" and d.text == "Hello , wo"


def test_stop_string_inside_one_token(tok) -> None:
    ids = enc(tok, "Hello , world . ok ?")
    d, res = feed(tok, ids, stop_strings=("orl",))
    assert res == [None, None, "orl"]
    assert d.text == "Hello , w"


def test_earliest_stop_string_wins(tok) -> None:
    ids = enc(tok, "Hello , world . ok ?")
    d, res = feed(tok, ids[:3], stop_strings=("ld", "rld", "world"))
    assert res[-1] == "world" and d.text == "Hello , "
    # one stop straddles the old text and the delta, the other lies in the delta only
    d, res = feed(tok, ids[:4], stop_strings=(" .", "d ."))
    assert res == [None, None, None, "d ."] and d.text == "Hello , worl"
    d, res = feed(tok, ids[:4], stop_strings=(" .", "d ."), include_stop_str=True)
    assert d.text == "Hello , world ."


def test_stop_string_after_multibyte_text(tok) -> None:
    ids = enc(tok, "café 日本語 😀 naïve")
    d, res = feed(tok, ids, stop_strings=("語 😀",))
    assert res[-1] == "語 😀" and res[:-1] == [None] * (len(res) - 1)
    assert d.text == "café 日本"


def test_no_stop_found(tok) -> None:
    ids = enc(tok, "Hello , world . ok ?")
    d, res = feed(tok, ids, stop_strings=("xyz", "okay"))
    assert res == [None] * len(ids) and d.text == "Hello , world . ok ?"


def test_visible_text_holds_back_a_possible_partial_stop(tok) -> None:
    text = "Hello , world . ok ?"
    ids = enc(tok, text)
    d = IncrementalDetokenizer(tok, [], stop_strings=("world ?", "!"))
    d.add(ids[0])
    d.add(ids[1])
    d.add(ids[2])
    assert d.text == "Hello , world"  # ends with "world", a prefix of "world ?"
    assert "world" not in d.visible_text(False)
    assert d.visible_text(True) == "Hello , world"
    # including the stop string in the output: nothing needs holding back
    d2 = IncrementalDetokenizer(tok, [], stop_strings=("world ?",), include_stop_str=True)
    for t in ids[:3]:
        d2.add(t)
    assert d2.visible_text(False) == "Hello , world"
    # no stop strings: nothing held back
    d3 = IncrementalDetokenizer(tok, [])
    for t in ids[:3]:
        d3.add(t)
    assert d3.visible_text(False) == "Hello , world"


@pytest.mark.parametrize("stops", [(". ok",), ("o , w", "k ?"), (" ?",), ("world . ok ?", "d .")])
def test_visible_text_never_shows_what_is_later_cut(tok, stops) -> None:
    ids = enc(tok, "Hello , world . ok ?")
    d = IncrementalDetokenizer(tok, [], stop_strings=stops)
    shown = []
    for t in ids:
        stop = d.add(t)
        finished = stop is not None
        shown.append(d.visible_text(finished))
        if finished:
            break
    final = d.text
    assert stop is not None
    for s in shown:
        assert final.startswith(s)
    assert shown[-1] == final


def test_prompt_ending_inside_a_character_keeps_it(tok) -> None:
    """Token-id prompts can end between the bytes of one character; the output completes it."""
    ids = enc(tok, TEXTS[0])
    cut = next(i for i in range(1, len(ids)) if "\ufffd" in tok.decode(ids[:i]))
    d = IncrementalDetokenizer(tok, ids[:cut])
    for t in ids[cut:]:
        d.add(t)
    full = tok.decode(ids)
    clean = max(k for k in range(cut + 1) if not tok.decode(ids[:k]).endswith("\ufffd"))
    assert tok.decode(ids[:clean]) + d.text == full  # nothing lost, nothing doubled
    assert "\ufffd" not in d.text
