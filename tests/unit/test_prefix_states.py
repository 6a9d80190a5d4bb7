"""The layers below the learned ones run from a kept shared prefix (learning/prefix_states.py), on
the default model's packed weights: a sequence's rows are bitwise those of a run from its start
whatever was kept before it, equal to `hidden_before`'s within float rounding, only the positions
after the last chunk boundary inside the shared prefix run, and the kept states stay within their
bound."""

from __future__ import annotations

import pytest
import torch

from ruvllm.learning.prefix_states import PrefixStates
from ruvllm.learning.tail import hidden_before

HEADER = list(range(300, 340))  # a chat template's header and system prompt, as every completion starts
A = HEADER + [17, 23, 99, 4, 250, 8, 61, 5, 77, 1200, 31, 2]
B = HEADER + [18, 44, 7, 930, 12, 66, 3, 410, 9]


@pytest.fixture(scope="module")
def model():  # noqa: ANN201
    from ruvllm.learning.tail import load_learning_model
    from ruvllm.loader.source import resolve_model

    return load_learning_model(resolve_model(None))[0]


def test_rows_from_a_kept_prefix_are_bitwise_a_run_from_the_start(model) -> None:  # noqa: ANN001
    first = model.cfg.num_layers - 4
    kept = PrefixStates(model, first)
    kept.hidden(A)
    assert kept.rows_run == len(A)
    b = kept.hidden(B)  # shares the 40-token header: starts at position 32
    assert kept.rows_run == len(A) + len(B) - 32
    fresh = PrefixStates(model, first)
    assert torch.equal(b, fresh.hidden(B))
    assert fresh.rows_run == len(B)
    reference = hidden_before(model, B, first)
    assert b.shape == reference.shape and b.dtype == torch.float32
    assert (b - reference).abs().max() <= 1e-4 * reference.abs().max()
    again = kept.hidden(A)  # kept whole: its last chunk runs again, the same bits
    assert torch.equal(again, PrefixStates(model, first).hidden(A))
    assert kept.rows_run == len(A) + len(B) - 32 + (len(A) - 32)


def test_a_short_shared_prefix_is_not_used_and_the_bound_holds(model) -> None:  # noqa: ANN001
    first = model.cfg.num_layers - 4
    kept = PrefixStates(model, first, min_shared=41)
    kept.hidden(A)
    kept.hidden(B)  # shares 40 tokens, under min_shared: from the start
    assert kept.rows_run == len(A) + len(B)
    one = PrefixStates(model, first)
    one.hidden(A)
    size = one._bytes
    bounded = PrefixStates(model, first, max_bytes=size + size // 2)  # room for one sequence's states
    bounded.hidden(A)
    bounded.hidden(B)
    assert list(bounded._kept) == [tuple(B)] and bounded._bytes <= bounded.max_bytes
    assert PrefixStates(model, first, max_bytes=size - 1).hidden(A).shape[0] == len(A)  # too big to keep: run
