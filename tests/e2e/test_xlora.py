"""X-LoRA (issue 15): peft's X-LoRA models served through our scaling pass, classifier and mixed
adapter deltas, checked against peft itself (the oracle) on the same weights."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from ruvllm import LLM, SamplingParams
from tests.engine_fixtures import TINY_GQA, write_tiny_model
from tests.lora_fixtures import (DEFAULT_CONTINUATION, DEFAULT_PROMPT, assert_default_model_follows,
                                 make_experts, make_xlora, peft_logits)
from tests.reference import teacher_forced_logits

ATOL = 2e-4


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("xlora") / "base")


@pytest.fixture(scope="module")
def experts(base: Path) -> list[Path]:
    return make_experts(base)


def engine(base: Path, **kw: object) -> LLM:
    kw = {"num_blocks": 64, "max_loras": 4, **kw}
    return LLM(str(base), enable_lora=True, max_lora_rank=16, **kw)


def tokens(n: int, seed: int) -> list[int]:
    return torch.randint(2, TINY_GQA.vocab_size, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("settings", [
    dict(xlora_depth=2, xlora_size=32, layerwise_scalings=True),
    dict(xlora_depth=1),
    dict(xlora_depth=3, xlora_size=16, xlora_dropout_p=0.0, top_k_lora=2, enable_softmax_topk=True,
         enable_softmax=False, softmax_temperature=0.5, global_scaling_weight=1.5),
], ids=["layerwise-depth2", "depth1", "depth3-topk"])
def test_logits_match_peft(base: Path, experts: list[Path], tmp_path: Path, settings: dict) -> None:
    ref = make_xlora(base, tmp_path / "x", experts, seed=5, **settings)
    llm = engine(base, dtype="float32")  # peft's fp32 logits within ATOL: "auto" is bf16 on CPUs with native bf16
    llm.load_lora("x", tmp_path / "x")
    prompt, continuation = tokens(29, 0), tokens(9, 1)
    expected = peft_logits(ref, prompt, continuation)
    base_logits = teacher_forced_logits(llm.core.kv, llm.core.executor.runner, prompt, continuation)
    assert (expected - base_logits).abs().max() > 0.1, "the adapters must change the logits for the test to mean anything"
    for chunk in (None, 6):
        ours = teacher_forced_logits(llm.core.kv, llm.core.executor.runner, prompt, continuation, chunk, "x")
        assert (ours - expected).abs().max().item() < ATOL
        assert torch.equal(ours.argmax(-1), expected.argmax(-1))
    assert llm.core.kv.num_free_blocks == llm.core.kv.pool.num_blocks


@pytest.fixture(scope="module")
def xlora_model(base: Path, experts: list[Path]) -> tuple[Path, torch.nn.Module]:
    folder = base.parent / "x"
    return folder, make_xlora(base, folder, experts, seed=7, xlora_depth=2, xlora_size=32, layerwise_scalings=True)


GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=2)


def _result(out) -> tuple[list[int], list]:
    c = out.outputs[0]
    return c.token_ids, [{t: lp.logprob for t, lp in d.items()} for d in c.logprobs]


def test_greedy_text_is_peft_generate(base: Path, xlora_model: tuple[Path, torch.nn.Module]) -> None:
    folder, ref = xlora_model
    prompt = tokens(14, 3)
    with torch.no_grad():
        expected = ref.generate(torch.tensor([prompt]), max_new_tokens=10, do_sample=False)[0, len(prompt):].tolist()
    llm = engine(base, dtype="float32")  # peft's fp32 greedy text
    llm.load_lora("x", folder)
    assert llm.generate([prompt], GREEDY, lora="x")[0].outputs[0].token_ids == expected


def test_mixed_batch_equals_each_alone(base: Path, experts: list[Path], xlora_model: tuple[Path, torch.nn.Module]) -> None:
    """X-LoRA rows (two passes), a plain adapter's rows and base rows in one batch: each request's
    tokens and logprobs are the ones it gets alone, and every KV block comes back."""
    llm = engine(base)
    llm.load_lora("x", xlora_model[0])
    llm.load_lora("a", experts[0])
    names = [("x", "a", None)[i % 3] for i in range(12)]
    prompts = [tokens(5 + 4 * i, 100 + i) for i in range(12)]
    together = llm.generate(prompts, GREEDY, lora=names)
    llm.reset_prefix_cache()
    for p, name, out in zip(prompts, names, together):
        assert _result(llm.generate([p], GREEDY, lora=name)[0]) == _result(out), name
    stats = llm.stats()
    assert stats.free_blocks == stats.total_blocks


def test_preempted_xlora_requests_recompute_both_streams(base: Path, xlora_model: tuple[Path, torch.nn.Module]) -> None:
    """A pool too small for every X-LoRA request's two block tables: requests are preempted (both
    tables freed) and recomputed, with the outputs they get alone."""
    prompts = [tokens(30, 200 + i) for i in range(6)]  # 2 blocks a stream on admission, 3 when done
    roomy = engine(base)
    roomy.load_lora("x", xlora_model[0])
    alone = [_result(roomy.generate([p], GREEDY, lora="x")[0]) for p in prompts]
    tight = engine(base, num_blocks=16, block_size=16)
    tight.load_lora("x", xlora_model[0])
    outs = tight.generate(prompts, GREEDY, lora="x")
    assert tight.stats().preemptions > 0
    assert [_result(o) for o in outs] == alone
    stats = tight.stats()
    assert stats.free_blocks == stats.total_blocks


def test_prefix_cache_with_two_streams(base: Path, xlora_model: tuple[Path, torch.nn.Module]) -> None:
    """A prompt the X-LoRA model saw is a hit for both its streams; its scaling pass registered
    the base model's blocks, which a base request then hits with its own output unchanged."""
    llm = engine(base)
    llm.load_lora("x", xlora_model[0])
    prompt = tokens(70, 300)
    base_alone = _result(llm.generate([prompt], GREEDY)[0])
    llm.reset_prefix_cache()
    first = llm.generate([prompt], GREEDY, lora="x")[0]
    assert first.num_cached_tokens == 0
    again = llm.generate([prompt], GREEDY, lora="x")[0]
    assert again.num_cached_tokens >= 64 and _result(again) == _result(first)
    hit = llm.generate([prompt], GREEDY)[0]
    assert hit.num_cached_tokens >= 64 and _result(hit) == base_alone
    assert _result(first) != base_alone


def test_two_xlora_models_over_too_few_slots_take_turns(base: Path, experts: list[Path], tmp_path: Path) -> None:
    """Two X-LoRA models of three adapters each and four slots: never both in one batch (each
    needs three slots), and every request still gets its output alone."""
    make_xlora(base, tmp_path / "x1", experts, seed=21, xlora_depth=1)
    make_xlora(base, tmp_path / "x2", experts[::-1], seed=22, xlora_depth=1)
    llm = engine(base)
    llm.load_lora("x1", tmp_path / "x1")
    llm.load_lora("x2", tmp_path / "x2")
    names = ["x1", "x2"] * 3
    prompts = [tokens(12, 400 + i) for i in range(6)]
    together = llm.generate(prompts, GREEDY, lora=names)
    for p, name, out in zip(prompts, names, together):
        assert _result(llm.generate([p], GREEDY, lora=name)[0]) == _result(out)


def _copy_with_config(src: Path, dst: Path, **changes: object) -> Path:
    import json
    import shutil

    shutil.copytree(src, dst)
    config = json.loads((dst / "adapter_config.json").read_text())
    config.update(changes)
    (dst / "adapter_config.json").write_text(json.dumps(config))
    return dst


@pytest.mark.parametrize("change,message", [
    (dict(scaling_pass_value=0.5), "scaling_pass_value 0.5 is not supported"),
    (dict(hidden_size=64), "hidden_size 64, and this model's is 128"),
    (dict(layerwise_scalings=False), "the X-LoRA classifier's linear 3 is (42, 32), expected (3, 32)"),
    (dict(xlora_depth=3), "the X-LoRA classifier's linear 3 is (42, 32), expected (32, 32)"),
    (dict(adapters={"0": "/nonexistent/adapter"}), "adapter '0' is at /nonexistent/adapter, and no folder is there"),
    (dict(use_trainable_adapters=True), "use_trainable_adapters is not supported"),
], ids=["scaling-pass-value", "hidden-size", "classifier-shape", "classifier-missing", "expert-missing", "trainable"])
def test_bad_xlora_models_are_refused_by_name(base: Path, xlora_model: tuple[Path, torch.nn.Module], tmp_path: Path,
                                              change: dict, message: str) -> None:
    from ruvllm.errors import AdapterError

    bad = _copy_with_config(xlora_model[0], tmp_path / "bad", **change)
    llm = engine(base)
    with pytest.raises(AdapterError, match=re.escape(message)):
        llm.load_lora("bad", bad)
    assert llm.loras() == []


def test_more_experts_than_slots_is_refused(base: Path, xlora_model: tuple[Path, torch.nn.Module]) -> None:
    from ruvllm.errors import AdapterError

    llm = engine(base, max_loras=2)
    with pytest.raises(AdapterError, match="mixes 3 adapters and this engine has 2 adapter slots"):
        llm.load_lora("x", xlora_model[0])


@pytest.fixture(scope="module")
def default_xlora(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.nn.Module]:
    """Two rank-8 adapters on the embedded default model and an X-LoRA model over them, peft over
    the model's weights dequantized to fp32 (what `quantization="none"` runs)."""
    from peft import LoraConfig, get_peft_model

    from ruvllm.loader import resolve_model
    from tests.lora_fixtures import ALL
    from tests.reference import hf_reference

    root = tmp_path_factory.mktemp("default-xlora")
    # One load of transformers' model serves all three: each adapter is unloaded (peft takes its
    # layers out, the base weights untouched) before the next is made; loading it for each took 4 s.
    hf = hf_reference(resolve_model(None))
    for i in range(2):
        torch.manual_seed(30 + i)
        model = get_peft_model(hf, LoraConfig(r=8, lora_alpha=16, target_modules=ALL, init_lora_weights=False))
        with torch.no_grad():  # peft's random B is large for a 576-wide model: keep each delta a nudge
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.mul_(0.05)
        model.save_pretrained(root / f"e{i}")
        hf = model.unload()
    ref = make_xlora(None, root / "x", [root / "e0", root / "e1"], seed=9, model=hf,
                     xlora_depth=2, xlora_size=64, layerwise_scalings=True)
    return root / "x", ref


def test_default_model_fp32_logits_match_peft(default_xlora: tuple[Path, torch.nn.Module]) -> None:
    folder, ref = default_xlora
    llm = LLM(enable_lora=True, max_loras=2, max_lora_rank=8, dtype="float32", quantization="none", num_blocks=64)
    llm.load_lora("x", folder)
    base_logits = teacher_forced_logits(llm.core.kv, llm.core.executor.runner, DEFAULT_PROMPT, DEFAULT_CONTINUATION)
    assert_default_model_follows(llm, "x", ref, base_logits, ATOL)


def test_default_precision_mixed_batch_equals_alone(default_xlora: tuple[Path, torch.nn.Module]) -> None:
    """The embedded default (Q4_1 codes, 8-bit activations) with the X-LoRA model beside the base."""
    llm = LLM(enable_lora=True, max_loras=2, max_lora_rank=8)
    llm.load_lora("x", default_xlora[0])
    prompts = ["The capital of France is", "Once upon a time", "def fibonacci(n):", "My favourite colour is"]
    names = ["x", None, "x", None]
    together = llm.generate(prompts, GREEDY, lora=names)
    llm.reset_prefix_cache()
    for p, name, out in zip(prompts, names, together):
        assert _result(llm.generate([p], GREEDY, lora=name)[0]) == _result(out)
    plain = llm.generate(prompts, GREEDY)
    mixed = llm.generate(prompts, GREEDY, lora="x")
    assert any(_result(p) != _result(m) for p, m in zip(plain, mixed))
