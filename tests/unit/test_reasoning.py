"""The reasoning splitter (tools/reasoning.py) on text cut into pieces every way a stream may cut it:
the pieces always join to what the whole text splits into, whatever the cuts (tags split across
pieces included), with and without the opening tag; and which templates make a model a thinking one."""

from __future__ import annotations

import pytest

from ruvllm.tools.reasoning import QWEN3, ReasoningSplitter, ReasoningTags, opens_reasoning, split_reasoning, tags_for


def _streamed(pieces: list[str], inside: bool, tags: ReasoningTags = QWEN3) -> tuple[str, str, bool]:
    s = ReasoningSplitter(tags, inside)
    out = [s.feed(p) for p in pieces] + [s.finish()]
    return "".join(r for r, _ in out), "".join(c for _, c in out), s.opened


CASES = [  # (text, inside, reasoning, content)
    ("<think>\nabc\n</think>\n\nanswer", False, "abc", "answer"),
    ("  <think>a b</think>x", False, "a b", "x"),
    ("<think></think>answer", False, "", "answer"),
    ("plain answer <think>not reasoning</think>", False, None, "plain answer <think>not reasoning</think>"),
    ("  plain", False, None, "  plain"),
    ("<thi", False, None, "<thi"),  # a tag's start that never completes is text
    ("<think>\nunfinished thought\n", False, "unfinished thought\n", ""),
    ("abc\n</think>\n\nanswer", True, "abc", "answer"),  # the prompt opened it: only the end tag comes
    ("still thinking </thi", True, "still thinking </thi", ""),
    ("a</think>b</think>c", True, "a", "b</think>c"),  # once ended, everything is content
    ("x < y </ z</think>ok", True, "x < y </ z", "ok"),
]


@pytest.mark.parametrize("text,inside,reasoning,content", CASES)
def test_whole_and_every_cut_agree(text: str, inside: bool, reasoning: str | None, content: str) -> None:
    assert split_reasoning(text, QWEN3, inside) == (reasoning, content)
    expected = ("" if reasoning is None else reasoning, content, reasoning is not None)
    for size in (1, 2, 3, 5):  # every piece size, so a tag lands across every cut
        pieces = [text[i:i + size] for i in range(0, len(text), size)]
        assert _streamed(pieces, inside) == expected, size
    for cut in range(len(text) + 1):  # and every single cut
        assert _streamed([text[:cut], text[cut:]], inside) == expected, cut


def test_pieces_go_out_as_soon_as_known() -> None:
    """Reasoning streams as it comes; only what may be a tag's start (or the whitespace before the
    end tag) waits for the next piece."""
    s = ReasoningSplitter(QWEN3, inside=False)
    assert s.feed("<th") == ("", "")
    assert s.feed("ink>\nLet me") == ("Let me", "")
    assert s.feed(" see.\n</") == (" see.", "")
    assert s.feed("think>\n\nYes") == ("", "Yes")
    assert s.feed(" indeed") == ("", " indeed")
    assert s.finish() == ("", "")


def test_tags_of_a_setting_and_of_templates() -> None:
    assert tags_for(None, "[R],[/R]") == ReasoningTags("[R]", "[/R]")
    assert tags_for("{{ '<think>' }}", "off") is None
    assert tags_for("{% if enable_thinking %}{% endif %}", None) == QWEN3
    assert tags_for("{{ '<think>\\n' }}", None) == QWEN3
    assert tags_for("{% for m in messages %}{{ m.content }}{% endfor %}", None) is None
    assert tags_for(None, None) is None
    with pytest.raises(ValueError, match="START,END"):
        tags_for(None, "<think>")
    custom = ReasoningTags("[R]", "[/R]")
    assert split_reasoning("[R]why[/R]so", custom, False) == ("why", "so")


def test_whether_a_prompt_opens_the_reasoning() -> None:
    assert opens_reasoning("<|im_start|>assistant\n<think>\n", QWEN3)
    assert not opens_reasoning("<|im_start|>assistant\n<think>\n\n</think>\n\n", QWEN3)
    assert not opens_reasoning("<|im_start|>assistant\n", QWEN3)
    assert opens_reasoning("<think>\nold\n</think>\nold answer<|im_end|><|im_start|>assistant\n<think>\n", QWEN3)


def test_a_grammar_that_starts_after_the_reasoning() -> None:
    """structured/bitmask.py's AfterTokens over a real xgrammar matcher: no mask while waiting (the
    row's logits untouched beside a constrained row), the grammar's mask from the end tag on, and a
    rollback (speculative proposals) that crosses the end tag waits again."""
    import torch
    import xgrammar as xgr

    from ruvllm.structured.bitmask import AfterTokens, apply_grammar_masks, new_matcher
    from tests.reasoning_fixtures import thinking_tokenizer

    tok = thinking_tokenizer()
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=len(tok),
                                              stop_token_ids=[tok.convert_tokens_to_ids("<|im_end|>")])
    compiled = xgr.GrammarCompiler(info).compile_regex("yes")
    end = tok.convert_tokens_to_ids("</think>")
    waiting, started = new_matcher(compiled, (end,)), new_matcher(compiled, (end,))
    assert isinstance(waiting, AfterTokens)
    free = tok.encode("free text", add_special_tokens=False)
    for t in free:
        assert waiting.accept_token(t) and started.accept_token(t)
    assert started.accept_token(end) and not started.waiting and waiting.waiting

    class Row:
        def __init__(self, matcher):
            self.matcher = matcher

    logits = torch.randn(2, len(tok))
    masked = logits.clone()
    apply_grammar_masks(masked, [Row(waiting), Row(started)])
    assert torch.equal(masked[0], logits[0])  # the waiting row: nothing masked
    allowed = torch.isfinite(masked[1]).nonzero().flatten().tolist()
    assert allowed == tok.encode("y", add_special_tokens=False)
    assert started.accept_token(allowed[0]) and not started.accept_token(end)  # held to the grammar now
    started.rollback(2)  # the "y" and the end tag: waiting again, the grammar back at its start
    assert started.waiting and started.accept_token(end) and not started.waiting
    assert started.accept_token(allowed[0])
