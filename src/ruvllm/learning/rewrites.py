"""Question forms the model writes itself (issue 37 item 2's first candidate): a correction is also
learned under rewrites of the question it answers, so that it holds when the question is asked in
other words.

The writer is the served base model, asked by example: a chat request to rewrite a question made
the default 135M model answer it instead (45 samples: three instructions, the five tuning facts'
questions, three samples each; none was a rewrite), while three question-and-rewrite pairs as
plain text, then the question, made it write a rewrite: greedily close ones ("What is the capital
of the planet Zorblax?"), sampled ones
some that drift to another subject ("What is the capital of Zorblock?", "What is the national dish
of Poland?"). So the samples are filtered: a rewrite keeps every name of the question (a word
written with a capital inside the sentence, or one the tokenizer splits into pieces: the made-up
words a taught fact is about), is near the question by the pattern bank's embedding
(bank.PromptEmbedder), and is not the question or a rewrite kept before it again.
"""

from __future__ import annotations

import re
from collections.abc import Callable

import torch
import torch.nn.functional as F

# Three pairs of a question and the same question in other words, then the question to rewrite.
SHOTS = ("Question: Where is the Eiffel Tower?\nThe same question in other words: In which city does the Eiffel "
         "Tower stand?\n\nQuestion: Who wrote Hamlet?\nThe same question in other words: Which author wrote the "
         "play Hamlet?\n\nQuestion: How old is the Earth?\nThe same question in other words: What is the age of "
         "the Earth?\n\nQuestion: {question}\nThe same question in other words:")
# The embedding's bounds (cosine with the question): under NEAR, another question (different
# questions of the same form measured up to 0.946, paraphrases 0.83-0.96: bank.PromptEmbedder); at
# SAME or over, the same text again (rewrites that only add a word or two measured 0.957-0.980).
NEAR, SAME = 0.8, 0.995
_WORD = re.compile(r"[A-Za-z0-9][A-Za-z0-9'-]*")


def names(question: str, tokenizer) -> list[str]:  # noqa: ANN001
    """The words a rewrite must keep: capitalized ones after the first word, and words of at least
    four letters that the tokenizer splits into two or more pieces (written after a space)."""
    words = _WORD.findall(question)
    kept = []
    for i, word in enumerate(words):
        rare = len(word) >= 4 and len(tokenizer.encode(" " + word, add_special_tokens=False)) >= 2
        if (i > 0 and word[0].isupper()) or rare:
            kept.append(word)
    return kept


def kept_rewrites(question: str, texts: list[str], n: int, must_keep: list[str],
                  embed: Callable[[str], torch.Tensor]) -> list[str]:
    """Up to n of the written `texts` (in order) that keep every word of `must_keep`, are near the
    question by `embed`'s vectors (cosine NEAR or more) and are not the question or one kept before
    again (cosine SAME or more). Each text is cut at its first line."""
    seen = [F.normalize(embed(question), dim=0)]
    kept: list[str] = []
    for text in texts:
        text = text.strip().split("\n")[0].strip().strip('"').strip()
        if not text or len(text) > 3 * len(question) or any(w.lower() not in text.lower() for w in must_keep):
            continue
        vec = F.normalize(embed(text), dim=0)
        if float(vec @ seen[0]) < NEAR or any(float(vec @ s) >= SAME for s in seen):
            continue
        kept.append(text)
        seen.append(vec)
        if len(kept) == n:
            break
    return kept

