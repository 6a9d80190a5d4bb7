"""Reasoning output: a thinking model writes its reasoning between two tags (Qwen3's `<think>` and
`</think>`) before its answer. This module finds those tags in the model's text, whole or piece by
piece as a stream brings it, and splits the text into the reasoning and the content (docs/server.md,
"Reasoning output"). Pure text: the server decides which models think and how each dialect serves
the two parts (server/reasoning.py)."""

from __future__ import annotations

from dataclasses import dataclass

OFF = "off"  # the setting's value that turns reasoning parsing off


@dataclass(frozen=True)
class ReasoningTags:
    start: str
    end: str

    @classmethod
    def parse(cls, value: str) -> ReasoningTags:
        """`START,END` (a setting's text); ValueError when either is missing."""
        start, sep, end = value.partition(",")
        if not sep or not start.strip() or not end.strip():
            raise ValueError(f"reasoning tags must be given as START,END (such as <think>,</think>), got {value!r}")
        return cls(start.strip(), end.strip())


QWEN3 = ReasoningTags("<think>", "</think>")


def tags_for(template: str | None, setting: str | None) -> ReasoningTags | None:
    """The tags a model's reasoning is read between, or None when it does not think: the setting's
    pair; `off`: none; unset: `<think>` ... `</think>` when the chat template writes `<think>` (Qwen3,
    QwQ and DeepSeek-R1 templates do: they strip or open reasoning there) or reads `enable_thinking`."""
    if setting is not None:
        return None if setting.strip().lower() == OFF else ReasoningTags.parse(setting)
    if template and (QWEN3.start in template or "enable_thinking" in template):
        return QWEN3
    return None


def opens_reasoning(prompt: str, tags: ReasoningTags) -> bool:
    """Whether the prompt leaves the reasoning open, so that the output starts inside it (and only
    the end tag appears in it): its last start tag comes after its last end tag. Templates that think
    by default (Qwen3's thinking models, DeepSeek-R1) end the prompt with the start tag; a prefill may."""
    start = prompt.rfind(tags.start)
    return start >= 0 and start > prompt.rfind(tags.end)


def _partial_suffix(text: str, tag: str) -> int:
    """The length of the longest end of `text` that is the start of `tag` (a tag the next piece may
    complete: held back rather than sent as text)."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


class ReasoningSplitter:
    """Splits a completion's text, fed piece by piece, into (reasoning, content) pieces. A tag may
    arrive split across pieces (tokens): a piece's end that could begin a tag is held until the next
    piece says. The start tag opens reasoning only before any content (whitespace aside); once the end
    tag has come everything is content. `inside`: the prompt opened the reasoning, so the text starts
    in it. Whitespace right after either tag, and right before the end tag, is the template's layout,
    not reasoning or content: left out (as Qwen3's template strips it when a turn is sent back)."""

    def __init__(self, tags: ReasoningTags, inside: bool) -> None:
        self.tags = tags
        self.state = "reasoning" if inside else "begin"  # begin -> reasoning -> content
        self.opened = inside  # whether there was any reasoning (None vs "" when there is no text)
        self._held = ""  # text not yet given out: a possible tag's start, or whitespace that may precede the end tag
        self._lead = True  # at the start of the current part: its leading whitespace is dropped

    def feed(self, text: str, final: bool = False) -> tuple[str, str]:
        """The new reasoning and content that `text` completes; `final`: nothing follows, so nothing
        is held back any more (a lone partial tag is text)."""
        buf, reasoning, content = self._held + text, [], []
        self._held = ""
        while buf:
            if self.state == "begin":
                stripped = buf.lstrip()
                if stripped.startswith(self.tags.start):
                    buf, self.state, self.opened, self._lead = stripped[len(self.tags.start):], "reasoning", True, True
                    continue
                if not final and self.tags.start.startswith(stripped):  # whitespace, or the tag's beginning
                    self._held = buf
                    break
                self.state, self._lead = "content", False  # no reasoning: the text is all content, as written
                continue
            if self._lead:
                buf = buf.lstrip()
                if not buf:
                    break
                self._lead = False
            if self.state == "content":
                content.append(buf)
                break
            at = buf.find(self.tags.end)
            if at >= 0:
                reasoning.append(buf[:at].rstrip())
                buf, self.state, self._lead = buf[at + len(self.tags.end):], "content", True
                continue
            keep = 0 if final else _partial_suffix(buf, self.tags.end)
            body = buf[:len(buf) - keep]
            if not final:  # trailing whitespace may be the layout before the end tag: held until text follows
                keep += len(body) - len(body.rstrip())
                body = body.rstrip()
            reasoning.append(body)
            self._held = buf[len(body):]
            break
        return "".join(reasoning), "".join(content)

    def finish(self) -> tuple[str, str]:
        return self.feed("", final=True)


def split_reasoning(text: str, tags: ReasoningTags, inside: bool) -> tuple[str | None, str]:
    """A whole completion's (reasoning, content); reasoning None when the text opened none. The same
    splitter a stream uses, so a stream's pieces join to exactly this."""
    splitter = ReasoningSplitter(tags, inside)
    r1, c1 = splitter.feed(text)
    r2, c2 = splitter.finish()
    return (r1 + r2 if splitter.opened else None), c1 + c2
