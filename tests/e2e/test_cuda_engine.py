"""The engine on an NVIDIA GPU (skipped without one): logits against the CPU path, batch
invariance, prefix-cache hit == miss, CUDA graphs == eager, and the KV pool sized by profiling."""

from __future__ import annotations

import dataclasses

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

from ruvllm import SamplingParams  # noqa: E402
from ruvllm.config import CacheConfig, EngineConfig  # noqa: E402
from ruvllm.worker.gpu_memory import InsufficientGPUMemoryError  # noqa: E402
from tests.engine_fixtures import TINY_GQA, tiny_llm  # noqa: E402

PROMPTS = [[(7 * i + j) % 500 + 2 for j in range(3 + 11 * i)] for i in range(12)]
GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, logprobs=0)


def _run(llm, prompts=PROMPTS, params=GREEDY):
    outs = llm.generate(prompts, params)
    stats = llm.stats()
    assert stats.free_blocks == stats.total_blocks, "KV blocks leaked"
    return ([o.outputs[0].token_ids for o in outs],
            [[next(iter(d.values())).logprob for d in o.outputs[0].logprobs] for o in outs])


@pytest.fixture(scope="module")
def cpu_fp32():
    return _run(tiny_llm("cpu", attention="torch"))


@pytest.mark.parametrize("graphs", [True, False])
def test_fp32_on_cuda_matches_the_cpu_path(cpu_fp32, graphs: bool) -> None:
    tokens, lps = _run(tiny_llm("cuda", cuda_graphs=graphs))
    assert tokens == cpu_fp32[0]
    for a, b in zip(lps, cpu_fp32[1]):
        assert a == pytest.approx(b, abs=1e-3)


def _prompt_logprobs(llm) -> torch.Tensor:
    """Teacher-forced: each prompt token's logprob given the ones before (no divergence between runs)."""
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0))
    return torch.tensor([next(iter(d.values())).logprob for o in outs for d in o.prompt_logprobs[1:]])


def test_bf16_on_cuda_stays_close_to_fp32() -> None:
    llm = tiny_llm("cuda", dtype="auto")
    assert llm.info.dtype == "bfloat16" and torch.device(llm.info.device).type == "cuda"
    diff = (_prompt_logprobs(llm) - _prompt_logprobs(tiny_llm("cpu", attention="torch"))).abs()
    # bf16 on the CPU path measures max 0.067, mean 0.014 on these 750 tokens.
    assert diff.max() < 0.15 and diff.mean() < 0.03


def test_batch_invariance_and_isolation_on_cuda() -> None:
    llm = tiny_llm("cuda", dtype="auto")
    together = _run(llm)[0]
    alone = [_run(llm, [p])[0][0] for p in PROMPTS]
    assert alone == together
    assert _run(llm)[0] == together  # again, after everything that ran before


def test_prefix_cache_hit_equals_miss_on_cuda() -> None:
    llm = tiny_llm("cuda", dtype="auto")
    shared = list(range(2, 60))
    prompts = [shared + [100 + i] for i in range(4)]
    first = _run(llm, prompts[:1])[0]
    hits = _run(llm, prompts)[0]  # the shared 48 tokens (3 full blocks) come from the cache
    llm.reset_prefix_cache()
    cache = llm.core.executor.config.cache  # the same settings for the fresh engines (the Worker's config)
    misses = [_run(tiny_llm("cuda", dtype="auto", cache=cache), [p])[0][0] for p in prompts]
    assert hits[0] == first[0] and hits == misses


def test_kv_pool_is_sized_by_profiling() -> None:
    llm = tiny_llm("cuda", dtype="auto", cache=CacheConfig(gpu_memory_utilization=0.5))
    total = torch.cuda.mem_get_info()[1]
    pool = llm.info.kv_cache_bytes  # one tier: the 16-bit pool's bytes
    assert 0.2 * total < pool < 0.5 * total


def test_weights_that_cannot_fit_fail_before_loading() -> None:
    huge = dataclasses.replace(TINY_GQA, vocab_size=4_000_000, hidden_size=16384)  # 131 GB of embeddings
    with pytest.raises(InsufficientGPUMemoryError, match=r"weights need \d+\.\d+ GiB"):
        tiny_llm("cuda", dtype="auto", cfg=huge)


def test_cuda_device_config_is_checked() -> None:
    with pytest.raises(ValueError, match="cuda:N"):
        tiny_llm("gpu")
    assert EngineConfig().device == "auto"
