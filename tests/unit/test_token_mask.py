"""The grammar's token mask: our C++ kernel and the torch-ops path give the same logits, bitwise,
for any bitmask (all allowed, none allowed, mixed; a vocabulary that is not a multiple of 32), on
a subset of the rows, leaving the other rows untouched."""

from __future__ import annotations

import pytest
import torch

from ruvllm.structured.bitmask import _kernels, unpack_and_mask


@pytest.mark.parametrize("vocab", [49152, 1000])
def test_the_kernel_equals_the_torch_path(vocab: int) -> None:
    ext = _kernels()
    if ext is None:
        pytest.skip("the C++ kernels are not built here")
    g = torch.Generator().manual_seed(vocab)
    words = torch.randint(-2**31, 2**31 - 1, (5, (vocab + 31) // 32), dtype=torch.int32, generator=g)
    words[1] = -1  # everything allowed
    words[2] = 0  # nothing allowed
    words[3, ::2] = -1
    rows = [0, 2, 3, 5, 6]
    logits = torch.randn(8, vocab, generator=g)
    expected = logits.clone()
    unpack_and_mask(expected, words, rows)
    ext.apply_token_bitmask(logits, words, torch.tensor(rows))
    assert torch.equal(logits, expected)
    # words[j] is rows[j]'s mask: row 2 allows everything, row 3 nothing; rows 1, 4, 7 are not masked
    assert torch.isinf(logits[3]).all() and not torch.isinf(logits[2]).any()
    assert not torch.isinf(logits[[1, 4, 7]]).any()
