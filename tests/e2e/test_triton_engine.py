"""The Triton attention backend inside the whole engine: same greedy tokens and logprobs as the
PyTorch backend on a tiny random model. Without a GPU it runs through Triton's interpreter."""

from __future__ import annotations

import pytest

pytest.importorskip("triton")

from ruvllm import SamplingParams  # noqa: E402
from tests.engine_fixtures import tiny_llm  # noqa: E402

import torch  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21], [40, 41], [100] * 35]


def _run(llm):
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=0)
    outs = llm.generate(PROMPTS, params)
    return [o.outputs[0].token_ids for o in outs], [[next(iter(d.values())).logprob for d in o.outputs[0].logprobs]
                                                     for o in outs]


def test_triton_backend_matches_torch_backend() -> None:
    tokens_t, lps_t = _run(tiny_llm(DEVICE, attention="triton", cuda_graphs=False))
    tokens_r, lps_r = _run(tiny_llm("cpu", attention="torch"))
    assert tokens_t == tokens_r
    for a, b in zip(lps_t, lps_r):
        assert a == pytest.approx(b, abs=1e-4)
