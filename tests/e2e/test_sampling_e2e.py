"""Sampling on the real model: seeds, stop strings and stop tokens, n > 1, logprobs, min_tokens."""

from __future__ import annotations

import math

from ruvllm import LLM, CacheConfig, SamplingParams
from tests.conftest import novel_prompts

PROMPT = "Write a short story about a cat who learns to fly."


def test_same_seed_same_output_whatever_shares_the_batch(llm: LLM) -> None:
    # Lengths as before in two thirds of the steps: others outlast the seeded request, one leaves early
    params = SamplingParams(temperature=1.0, top_k=50, top_p=0.95, max_tokens=16, seed=1234, ignore_eos=True)
    alone = llm.generate(PROMPT, params)[0].outputs[0].token_ids
    others = [SamplingParams(temperature=0.8, max_tokens=20, seed=s, ignore_eos=True) for s in range(5)]
    others += [SamplingParams(temperature=1.2, max_tokens=6, ignore_eos=True)]
    outs = llm.generate(["Tell me about dogs."] * 3 + [PROMPT] + ["Why is the sky blue?"] * 3,
                        others[:3] + [params] + others[3:])
    assert outs[3].outputs[0].token_ids == alone
    different = llm.generate(PROMPT, SamplingParams(temperature=1.0, top_k=50, top_p=0.95, max_tokens=16,
                                                    seed=4321, ignore_eos=True))[0].outputs[0].token_ids
    assert different != alone


def test_stop_string_cuts_at_the_right_place(llm: LLM) -> None:
    # 16 tokens: " Paris.\n\nThe answer is: 2018-01" holds the stop string (40 decoded 24 more, 1 s of CPU)
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    full = llm.generate("The capital of France is", greedy)[0].outputs[0].text
    stop = "answer"  # the greedy continuation is " Paris.\n\nThe answer is: ..."
    assert stop in full
    out = llm.generate("The capital of France is", SamplingParams(temperature=0, max_tokens=16, stop=[stop, "zzz"]))
    c = out[0].outputs[0]
    assert c.text == full[: full.index(stop)]
    assert c.finish_reason == "stop" and c.stop_reason == stop
    assert len(c.token_ids) < 16
    kept = llm.generate("The capital of France is",
                        SamplingParams(temperature=0, max_tokens=16, stop=stop, include_stop_str_in_output=True))
    assert kept[0].outputs[0].text == full[: full.index(stop) + len(stop)]


def test_stop_token_ids(llm: LLM) -> None:
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)  # the stop token is the 4th
    toks = llm.generate("The capital of France is", greedy)[0].outputs[0].token_ids
    out = llm.generate("The capital of France is",
                       SamplingParams(temperature=0, max_tokens=8, stop_token_ids=[toks[3]]))[0].outputs[0]
    assert out.token_ids == toks[: toks.index(toks[3]) + 1]
    assert out.finish_reason == "stop" and out.stop_reason == toks[3]


def test_eos_stops_and_min_tokens_delays_it(llm: LLM) -> None:
    chat = [{"role": "user", "content": "Say hi."}]
    out = llm.chat(chat, SamplingParams(temperature=0, max_tokens=200))[0].outputs[0]
    assert out.finish_reason == "stop" and out.token_ids[-1] in llm.eos_token_ids
    n = len(out.token_ids)
    longer = llm.chat(chat, SamplingParams(temperature=0, max_tokens=200, min_tokens=n + 5))[0].outputs[0]
    assert len(longer.token_ids) >= n + 5
    assert not set(longer.token_ids[: n + 4]) & set(llm.eos_token_ids)


def test_n_completions_share_the_prompt_blocks(llm: LLM) -> None:
    prompt = novel_prompts(1, words=80)[0]  # ~100 tokens: 6 full blocks
    hits_before = llm.stats().prefix_hits
    out = llm.generate(prompt, SamplingParams(n=4, temperature=1.0, max_tokens=12, seed=7, ignore_eos=True))[0]
    assert [c.index for c in out.outputs] == [0, 1, 2, 3]
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    n_prompt = len(out.prompt_token_ids)
    # Three of the four completions reuse every full block of the first one's prompt.
    assert llm.stats().prefix_hits - hits_before == 3 * ((n_prompt - 1) // 16 * 16)
    again = llm.generate(prompt, SamplingParams(n=4, temperature=1.0, max_tokens=12, seed=7, ignore_eos=True))[0]
    assert [c.token_ids for c in again.outputs] == [c.token_ids for c in out.outputs]


def test_logprobs_are_consistent(llm: LLM) -> None:
    out = llm.generate("The capital of France is", SamplingParams(temperature=0, max_tokens=5, logprobs=3))[0]
    c = out.outputs[0]
    assert c.logprobs is not None and len(c.logprobs) == len(c.token_ids)
    for tok, entry in zip(c.token_ids, c.logprobs):
        assert tok in entry and entry[tok].rank == 1  # greedy picks the top token
        assert len(entry) == 3
        assert all(lp.logprob <= 0 for lp in entry.values())
        assert sum(math.exp(lp.logprob) for lp in entry.values()) <= 1.0 + 1e-5


def test_repetition_penalty_changes_greedy_output(llm: LLM) -> None:
    prompt = "one two one two one two one two"
    plain = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0].outputs[0]
    penalised = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True,
                                                    repetition_penalty=2.0))[0].outputs[0]
    assert plain.token_ids != penalised.token_ids


def test_logit_bias_forces_a_token(llm: LLM) -> None:
    tok = llm.tokenizer.encode(" banana", add_special_tokens=False)[0]
    out = llm.generate("Hello", SamplingParams(temperature=0, max_tokens=3, logit_bias={tok: 100}))[0].outputs[0]
    assert out.token_ids == [tok] * 3


def test_prompts_as_token_ids_and_text_agree(llm: LLM) -> None:
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    by_text = llm.generate("Hello there", params)[0]
    by_ids = llm.generate([llm.tokenizer.encode("Hello there")], params)[0]
    assert by_text.outputs[0].token_ids == by_ids.outputs[0].token_ids
    assert by_text.prompt == "Hello there" and by_ids.prompt is None


def test_engine_seed_makes_unseeded_sampling_reproducible(llm: LLM) -> None:
    params = SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True)  # no per-request seed
    runs = []
    for _ in range(2):
        # a fresh engine: its generator starts from the config's seed (a small pool: 750 MB less to allocate)
        fresh = llm.with_settings(cache=CacheConfig(num_blocks=32))
        runs.append(fresh.generate([PROMPT, "Tell me about dogs."], params))
    assert [o.outputs[0].token_ids for o in runs[0]] == [o.outputs[0].token_ids for o in runs[1]]
