"""Sampler: truncation masks, greedy, temperature sampling, seeds, penalties, bias, bans, logprobs."""

from __future__ import annotations

import math

import pytest
import torch

from ruvllm.layers.sampler import SamplingState, apply_bans_and_bias, apply_penalties, sample, truncate
from ruvllm.sampling_params import SamplingParams

NEG = float("-inf")


def R(prompt=(0,), out=(), rid: str = "r", **params) -> SamplingState:
    r = SamplingState(rid, SamplingParams(**params), list(prompt), eos_token_ids=(2,))
    r.output_token_ids.extend(out)
    return r


def kept(masked: torch.Tensor) -> list[list[int]]:
    return [torch.isfinite(row).nonzero().squeeze(1).tolist() for row in masked]


def trunc(logits, top_k, top_p, min_p) -> torch.Tensor:
    n = logits.shape[0]
    return truncate(logits, torch.tensor(top_k if isinstance(top_k, list) else [top_k] * n),
                    torch.tensor(top_p if isinstance(top_p, list) else [top_p] * n, dtype=logits.dtype),
                    torch.tensor(min_p if isinstance(min_p, list) else [min_p] * n, dtype=logits.dtype))


# probs of [4, 3, 2, 1, 0]: 0.636 0.234 0.086 0.032 0.012 ; cumulative before: 0 .636 .870 .956 .988
# shuffled so that sorting and scattering back is exercised: token -> logit
SHUF = torch.tensor([[1.0, 4.0, 0.0, 3.0, 2.0]])  # rank order of tokens: 1, 3, 4, 0, 2


@pytest.mark.parametrize(("top_k", "top_p", "min_p", "expect"), [
    (0, 1.0, 0.0, [0, 1, 2, 3, 4]),
    (1, 1.0, 0.0, [1]),
    (2, 1.0, 0.0, [1, 3]),
    (4, 1.0, 0.0, [0, 1, 3, 4]),
    (9, 1.0, 0.0, [0, 1, 2, 3, 4]),
    (0, 0.5, 0.0, [1]),  # top token alone holds 0.636 >= 0.5
    (0, 0.8, 0.0, [1, 3]),  # 0.636 < 0.8 <= 0.870
    (0, 0.9, 0.0, [1, 3, 4]),
    (0, 0.97, 0.0, [0, 1, 3, 4]),
    (0, 0.01, 0.0, [1]),  # the top token always stays
    (0, 1.0, 0.1, [1, 3, 4]),  # p / p_max: 1 .368 .135 .050 .018
    (0, 1.0, 0.2, [1, 3]),
    (0, 1.0, 1.0, [1]),
    (3, 0.8, 0.0, [1, 3]),  # intersections
    (2, 1.0, 0.1, [1, 3]),
    (0, 0.97, 0.1, [1, 3, 4]),
])
def test_truncate_exact_masks(top_k, top_p, min_p, expect) -> None:
    out = trunc(SHUF.clone(), top_k, top_p, min_p)
    assert kept(out) == [expect]
    keep = torch.isfinite(out)
    assert torch.equal(out[keep], SHUF[keep])  # kept logits are unchanged
    assert torch.all(out[~keep] == NEG)


def test_truncate_is_per_row() -> None:
    logits = torch.cat([SHUF, SHUF.flip(1), SHUF])
    out = trunc(logits, [2, 0, 0], [1.0, 0.8, 1.0], [0.0, 0.0, 0.1])
    assert kept(out) == [[1, 3], [1, 3], [1, 3, 4]]


def test_greedy_rows_are_argmax() -> None:
    torch.manual_seed(0)
    logits = torch.randn(6, 50)
    reqs = [R(rid=str(i), temperature=0.0 if i % 2 == 0 else 1.0, top_k=5) for i in range(6)]
    tokens, lps = sample(logits, reqs)
    for i in (0, 2, 4):
        assert tokens[i] == int(logits[i].argmax())
    assert lps == [None] * 6


def test_sample_does_not_modify_callers_logits() -> None:
    logits = torch.randn(2, 10)
    before = logits.clone()
    sample(logits, [R(temperature=0.7, logit_bias={3: 5.0}, repetition_penalty=1.5, min_tokens=1),
                    R(temperature=0.0)])
    assert torch.equal(logits, before)


def test_temperature_sampling_matches_softmax() -> None:
    torch.manual_seed(1234)
    row = torch.tensor([1.0, 0.0, -1.0, 2.0, 0.5])
    temp = 0.7
    n = 20000
    tokens, _ = sample(row.repeat(n, 1), [R(rid=str(i), temperature=temp) for i in range(n)])
    freq = torch.bincount(torch.tensor(tokens), minlength=5).double() / n
    expect = (row.double() / temp).softmax(-1)
    assert torch.allclose(freq, expect, atol=0.012), (freq, expect)


def test_truncated_tokens_are_never_sampled() -> None:
    torch.manual_seed(7)
    n = 3000
    tokens, _ = sample(SHUF.repeat(n, 1), [R(rid=str(i), temperature=1.5, top_k=2) for i in range(n)])
    counts = torch.bincount(torch.tensor(tokens), minlength=5)
    assert counts[[0, 2, 4]].sum() == 0
    # renormalised over the two kept tokens: e^4 / (e^4 + e^3) at T=1.5
    p1 = 1 / (1 + math.exp(-1 / 1.5))
    assert abs(counts[1].item() / n - p1) < 0.03


def _draws(rows_fn, n_steps: int = 30) -> list[int]:
    """Sample n_steps times with a seeded request in a changing batch; its tokens."""
    target = R(rid="t", temperature=1.0, seed=123)
    flat = torch.zeros(1, 64)
    out = []
    for step in range(n_steps):
        others, pos = rows_fn(step)
        pos = min(pos, len(others))
        reqs = others[:pos] + [target] + others[pos:]
        logits = torch.randn(len(reqs), 64)
        logits[pos] = flat
        tokens, _ = sample(logits, reqs)
        out.append(tokens[pos])
    return out


def test_seeded_row_independent_of_batch() -> None:
    torch.manual_seed(0)
    alone = _draws(lambda step: ([], 0))
    torch.manual_seed(99)
    crowded = _draws(lambda step: ([R(rid="a", temperature=0.9),
                                    R(rid="b", temperature=0.0),
                                    R(rid="c", temperature=1.2, seed=step, top_p=0.5),
                                    R(rid="d", temperature=1.0, seed=7)][: 1 + step % 4], step % 3))
    assert alone == crowded
    assert len(set(alone)) > 10  # really random, not a constant


def test_different_seeds_differ_and_unseeded_follow_global_rng() -> None:
    flat = torch.zeros(1, 64)
    r0 = R(seed=1)
    a = [sample(flat, [r0])[0][0] for _ in range(20)]
    r1, r2 = R(seed=1), R(seed=2)
    s1 = [sample(flat, [r1])[0][0] for _ in range(20)]
    s2 = [sample(flat, [r2])[0][0] for _ in range(20)]
    assert s1 != s2
    assert a == s1  # same seed, same sequence
    torch.manual_seed(5)
    u1 = [sample(flat, [R()])[0][0] for _ in range(20)]
    torch.manual_seed(5)
    u2 = [sample(flat, [R()])[0][0] for _ in range(20)]
    assert u1 == u2


# --------------------------------------------------------------------------------- penalties, bias, bans

ROW = [2.0, -2.0, 1.0, -1.0, 0.5, 3.0]


def test_repetition_penalty_on_prompt_and_output_tokens() -> None:
    logits = torch.tensor([ROW])
    apply_penalties(logits, [R(prompt=[0, 1], out=[2, 2, 3], repetition_penalty=2.0)])
    assert logits.tolist() == [[1.0, -4.0, 0.5, -2.0, 0.5, 3.0]]


def test_repetition_penalty_below_one_boosts() -> None:
    logits = torch.tensor([ROW])
    apply_penalties(logits, [R(prompt=[5], out=[1], repetition_penalty=0.5)])
    assert logits.tolist() == [[2.0, -1.0, 1.0, -1.0, 0.5, 6.0]]


def test_presence_and_frequency_penalties_openai_formula() -> None:
    # logit[j] -= count[j] * frequency_penalty + (count[j] > 0) * presence_penalty, on output tokens only
    logits = torch.tensor([ROW])
    apply_penalties(logits, [R(prompt=[0, 1], out=[2, 2, 3, 2], presence_penalty=0.5, frequency_penalty=0.25)])
    assert logits[0].tolist() == pytest.approx([2.0, -2.0, 1.0 - 0.75 - 0.5, -1.0 - 0.25 - 0.5, 0.5, 3.0])


def test_penalty_counts_follow_the_output_as_it_grows() -> None:
    """The counts are kept between steps (not recounted): after more tokens, they equal a fresh count."""
    kw = dict(prompt=[0, 1], repetition_penalty=1.5, presence_penalty=0.5, frequency_penalty=0.25)
    grown = R(out=[2], **kw)
    apply_penalties(torch.tensor([ROW]), [grown])  # a first step builds the counts
    grown.output_token_ids.extend([2, 5, 3])
    after, fresh = torch.tensor([ROW]), torch.tensor([ROW])
    apply_penalties(after, [grown])
    apply_penalties(fresh, [R(out=[2, 2, 5, 3], **kw)])
    assert after.tolist() == fresh.tolist() and after.tolist() != [ROW]


def test_negative_presence_penalty_encourages() -> None:
    logits = torch.tensor([ROW])
    apply_penalties(logits, [R(out=[4], presence_penalty=-1.0)])
    assert logits[0, 4].item() == 1.5


def test_penalties_only_touch_rows_that_ask() -> None:
    logits = torch.tensor([ROW, ROW, ROW])
    apply_penalties(logits, [R(out=[0]), R(prompt=[5], out=[0], repetition_penalty=3.0, frequency_penalty=1.0),
                             R(out=[0, 5])])
    assert logits[0].tolist() == ROW and logits[2].tolist() == ROW
    assert logits[1].tolist() == pytest.approx([2 / 3 - 1, -2.0, 1.0, -1.0, 0.5, 1.0])


def test_repetition_penalty_changes_greedy_choice() -> None:
    logits = torch.tensor([[3.0, 2.0, 0.0]])
    assert sample(logits, [R(prompt=[0], temperature=0.0)])[0] == [0]
    assert sample(logits, [R(prompt=[0], temperature=0.0, repetition_penalty=2.0)])[0] == [1]


def test_logit_bias_adds() -> None:
    logits = torch.tensor([ROW, ROW])
    apply_bans_and_bias(logits, [R(logit_bias={1: 5.0, 5: -2.5}), R()])
    assert logits[0].tolist() == [2.0, 3.0, 1.0, -1.0, 0.5, 0.5]
    assert logits[1].tolist() == ROW
    assert sample(torch.tensor([ROW]), [R(temperature=0.0, logit_bias={3: 4.5})])[0] == [3]
    assert sample(torch.tensor([ROW]), [R(temperature=0.0, logit_bias={5: -100})])[0] == [0]


def test_min_tokens_bans_eos_and_stop_token_ids() -> None:
    logits = torch.tensor([ROW] * 4)
    reqs = [R(min_tokens=2, stop_token_ids=[4]),
            R(out=[7, 7], min_tokens=2, stop_token_ids=[4]),  # reached: nothing banned
            R(min_tokens=2, stop_token_ids=[4], ignore_eos=True),  # EOS not banned
            R(stop_token_ids=[4])]
    apply_bans_and_bias(logits, reqs)
    assert kept(logits) == [[0, 1, 3, 5], [0, 1, 2, 3, 4, 5], [0, 1, 2, 3, 5], [0, 1, 2, 3, 4, 5]]
    eos_top = torch.tensor([[0.0, 0.0, 9.0, 1.0]])
    assert sample(eos_top, [R(temperature=0.0, min_tokens=1)])[0] == [3]
    assert sample(eos_top, [R(temperature=0.0, min_tokens=1, out=[0])])[0] == [2]
    torch.manual_seed(0)
    toks, _ = sample(eos_top.repeat(200, 1), [R(rid=str(i), temperature=5.0, min_tokens=1) for i in range(200)])
    assert 2 not in toks


# --------------------------------------------------------------------------------- logprobs


def test_logprobs_of_chosen_token_are_raw_log_softmax() -> None:
    torch.manual_seed(3)
    logits = torch.randn(3, 40)
    raw = logits.log_softmax(-1)
    reqs = [R(rid="a", temperature=0.0, logprobs=0),
            R(rid="b", temperature=0.8, top_k=10, logprobs=3, repetition_penalty=1.3, prompt=list(range(20))),
            R(rid="c", temperature=0.0)]
    tokens, lps = sample(logits, reqs)
    assert lps[2] is None
    assert list(lps[0]) == [tokens[0]]
    assert lps[0][tokens[0]].rank == 1
    for i in (0, 1):
        tok = tokens[i]
        entry = lps[i][tok]
        assert entry.token_id == tok
        assert entry.logprob == pytest.approx(raw[i, tok].item(), abs=1e-6)
        assert entry.rank == int((raw[i] > raw[i, tok]).sum()) + 1


def test_logprobs_rank_and_top_n_when_chosen_is_not_top() -> None:
    logits = torch.tensor([[5.0, 4.0, 3.0, 2.0, 1.0, 0.0]])
    raw = logits.log_softmax(-1)[0]
    tokens, lps = sample(logits, [R(temperature=0.0, logit_bias={4: 50.0}, logprobs=2)])
    assert tokens == [4]
    entry = lps[0]
    assert set(entry) == {0, 1, 4}
    assert [(entry[t].rank, entry[t].token_id) for t in (0, 1, 4)] == [(1, 0), (2, 1), (5, 4)]
    for t in (0, 1, 4):
        assert entry[t].logprob == pytest.approx(raw[t].item(), abs=1e-6)


def test_logprobs_top_n_includes_chosen_once() -> None:
    logits = torch.tensor([[5.0, 4.0, 3.0]])
    _, lps = sample(logits, [R(temperature=0.0, logprobs=3)])
    assert sorted((e.rank, t) for t, e in lps[0].items()) == [(1, 0), (2, 1), (3, 2)]


def test_top_p_applies_to_what_top_k_left() -> None:
    """top_k=2 keeps [.4, .3] -> renormalised [.57, .43]; top_p=0.5 then keeps only the first."""
    logits = torch.log(torch.tensor([[0.4, 0.3, 0.3]]))
    out = truncate(logits, torch.tensor([2]), torch.tensor([0.5]), torch.tensor([0.0]))
    assert torch.isfinite(out).tolist() == [[True, False, False]]
