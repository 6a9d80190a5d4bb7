"""LoRA adapters against peft (the oracle) on the same base weights, and in mixed batches.

The adapters are made here with peft: random non-zero A and B (`init_lora_weights=False`) for the
numeric checks, and one trained for a few steps on a toy task so that it visibly changes outputs.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from peft import LoraConfig, get_peft_model
from safetensors.torch import load_file, save_file

from ruvllm import LLM, SamplingParams
from ruvllm.errors import AdapterError, AdapterNotFoundError
from ruvllm.messages import CoreRequest
from tests.engine_fixtures import TINY_GQA, write_tiny_model
from tests.lora_fixtures import (ALL, DEFAULT_CONTINUATION, DEFAULT_PROMPT, assert_default_model_follows, hf_model,
                                 make_adapter, peft_logits)
from tests.reference import teacher_forced_logits

ATOL = 2e-4


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("lora") / "base")


def engine(base: Path, **kw: object) -> LLM:
    return LLM(str(base), enable_lora=True, max_loras=kw.pop("max_loras", 6), max_lora_rank=kw.pop("max_lora_rank", 16),
               num_blocks=256, max_num_batched_tokens=256, **kw)


def our_logits(llm: LLM, adapter: str | None, prompt: list[int], continuation: list[int], chunk: int | None) -> torch.Tensor:
    return teacher_forced_logits(llm.core.kv, llm.core.executor.runner, prompt, continuation, chunk, adapter)


def random_case(ref: torch.nn.Module, prompt_len: int, continuation_len: int, seed: int) -> tuple[list[int], list[int], torch.Tensor, torch.Tensor]:
    """A random prompt and continuation, with peft's logits through the adapter and without it."""
    prompt = torch.randint(2, TINY_GQA.vocab_size, (prompt_len,), generator=torch.Generator().manual_seed(seed)).tolist()
    continuation = torch.randint(2, TINY_GQA.vocab_size, (continuation_len,), generator=torch.Generator().manual_seed(seed + 1)).tolist()
    expected = peft_logits(ref, prompt, continuation)
    with torch.no_grad(), ref.disable_adapter():
        base_logits = peft_logits(ref, prompt, continuation)
    return prompt, continuation, expected, base_logits


@pytest.mark.parametrize("targets,extra", [(ALL, {}), (["q_proj", "v_proj"], {}), (["o_proj", "down_proj"], {"use_rslora": True})],
                         ids=["all-seven", "q-v", "o-down-rslora"])
def test_logits_match_peft(base: Path, tmp_path: Path, targets: list[str], extra: dict) -> None:
    ref = make_adapter(base, tmp_path / "a", seed=1, targets=targets, **extra)
    llm = engine(base, dtype="float32")  # peft's fp32 logits within ATOL: "auto" is bf16 on CPUs with native bf16
    llm.load_lora("a", tmp_path / "a")
    prompt, continuation, expected, base_logits = random_case(ref, 37, 12, seed=0)
    assert (expected - base_logits).abs().max() > 0.1, "the adapter must change the logits for the test to mean anything"
    for chunk in (None, 5):
        ours = our_logits(llm, "a", prompt, continuation, chunk)
        diff = (ours - expected).abs().max().item()
        assert diff < ATOL, f"chunk {chunk}: max |logit diff| {diff:.2e}"
        assert torch.equal(ours.argmax(-1), expected.argmax(-1))
    # and the base model beside it is untouched
    assert (our_logits(llm, None, prompt, continuation, None) - base_logits).abs().max() < ATOL


def test_mixed_batch_equals_each_alone(base: Path, tmp_path: Path) -> None:
    """16 requests over 4 adapters and the base in one batch: each output is that request's alone."""
    llm = engine(base)
    for i in range(4):
        make_adapter(base, tmp_path / f"a{i}", seed=10 + i, r=4 + 4 * (i % 3))
        llm.load_lora(f"a{i}", tmp_path / f"a{i}")
    names = [None if i % 5 == 4 else f"a{i % 5}" for i in range(16)]
    prompts = [torch.randint(2, 500, (9 + 3 * i,), generator=torch.Generator().manual_seed(i)).tolist()
               for i in range(16)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    together = llm.generate(prompts, params, lora=names)
    llm.reset_prefix_cache()
    for p, name, out in zip(prompts, names, together):
        alone = llm.generate([p], params, lora=name)[0]
        assert alone.outputs[0].token_ids == out.outputs[0].token_ids, name
    base_out = llm.generate(prompts[:4], params)
    assert any(b.outputs[0].token_ids != t.outputs[0].token_ids for b, t in zip(base_out, together[:4]))
    stats = llm.stats()
    assert stats.free_blocks == stats.total_blocks


def test_prefix_cache_is_keyed_by_adapter(base: Path, tmp_path: Path) -> None:
    make_adapter(base, tmp_path / "a", seed=3)
    llm = engine(base)
    llm.load_lora("a", tmp_path / "a")
    prompt = [list(range(10, 90))]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    plain = llm.generate(prompt, params)[0]
    first = llm.generate(prompt, params, lora="a")[0]
    assert first.num_cached_tokens == 0  # the base's blocks are no hit for the adapter
    again = llm.generate(prompt, params, lora="a")[0]
    assert again.num_cached_tokens > 0 and again.outputs[0].token_ids == first.outputs[0].token_ids
    # a name loaded again is another adapter: nothing computed under the old one is reused
    llm.unload_lora("a")
    make_adapter(base, tmp_path / "b", seed=4)
    llm.load_lora("a", tmp_path / "b")
    reloaded = llm.generate(prompt, params, lora="a")[0]
    assert reloaded.num_cached_tokens == 0
    assert plain.outputs[0].token_ids != first.outputs[0].token_ids


def test_trained_adapter_changes_greedy_text_as_peft_does(base: Path, tmp_path: Path) -> None:
    """An adapter trained for a few steps to answer every prompt with token 7: peft's greedy text
    and ours are equal, and differ from the base model's."""
    torch.manual_seed(0)
    model = get_peft_model(hf_model(base), LoraConfig(r=8, lora_alpha=16, target_modules=ALL))
    model.train()
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    gen = torch.Generator().manual_seed(5)
    for _ in range(30):
        x = torch.randint(2, 500, (8, 12), generator=gen)
        labels = torch.full_like(x, -100)
        x[:, 6:] = 7
        labels[:, 6:] = 7
        loss = model(input_ids=x, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    model.save_pretrained(tmp_path / "sevens")
    prompt = torch.randint(2, 500, (10,), generator=torch.Generator().manual_seed(99)).tolist()
    with torch.no_grad():
        expected = model.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False)[0, len(prompt):].tolist()
    llm = engine(base)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    ours = llm.generate([prompt], params, lora=str(tmp_path / "sevens"))[0].outputs[0].token_ids
    assert ours == expected
    assert ours.count(7) >= 6
    assert llm.generate([prompt], params)[0].outputs[0].token_ids.count(7) < 6


def test_unload_lets_running_requests_finish(base: Path, tmp_path: Path) -> None:
    make_adapter(base, tmp_path / "a", seed=6)
    llm = engine(base)
    llm.load_lora("a", tmp_path / "a")
    core = llm.core
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    core.add_request(CoreRequest("r1", list(range(5, 30)), params, adapter="a"))
    tokens = [t for out in core.step() for t in out.new_token_ids]
    llm.unload_lora("a")
    assert llm.loras() == []
    with pytest.raises(AdapterNotFoundError):
        core.add_request(CoreRequest("r2", list(range(5, 30)), params, adapter="a"))
    while core.has_unfinished:
        for out in core.step():
            tokens += out.new_token_ids
    assert len(tokens) == 20
    assert core.executor.lora.names() == []  # the slot is free once its last request ended
    stats = llm.stats()
    assert stats.free_blocks == stats.total_blocks


def _corrupt(folder: Path) -> None:
    (folder / "adapter_model.safetensors").write_bytes(b"\x00" * 40)


def _edit_config(folder: Path, **changes: object) -> None:
    path = folder / "adapter_config.json"
    config = json.loads(path.read_text())
    config.update(changes)
    path.write_text(json.dumps(config))


def _add_tensor(folder: Path, key: str, tensor: torch.Tensor) -> None:
    path = folder / "adapter_model.safetensors"
    tensors = load_file(str(path))
    tensors[key] = tensor
    save_file(tensors, str(path))


@pytest.mark.parametrize("case,message", [
    ("missing", "no such folder"),
    ("corrupt", "not a readable safetensors file"),
    ("rank", "over the maximum 16"),
    ("target", "do not exist in this model"),
    ("hidden", "an adapter for another base model"),
    ("dora", "DoRA"),
    ("modules_to_save", "modules_to_save"),
    ("embedding", "LoRA on embeddings"),
    # issue 33: each of these loaded (200) or failed as an internal error ("EngineDeadError: division by zero")
    ("alpha-nan", "lora_alpha must be a positive finite number, got nan"),
    ("alpha-inf", "lora_alpha must be a positive finite number, got inf"),
    ("alpha-huge", "scaling .* is 1e\\+29, over 10000"),
    ("alpha-pattern-nan", "alpha_pattern\\['q_proj'\\] must be a positive finite number"),
    ("alpha-pattern-string", "alpha_pattern must map module names to numbers"),
    ("target-number", "target_modules must be a module name or a list of them, got \\[5\\]"),
    ("rank-zero", "has rank 0"),
    ("nul-path", "no such folder"),
    ("long-name", "is not usable"),
])
def test_bad_adapters_are_refused_by_name(base: Path, tmp_path: Path, case: str, message: str) -> None:
    folder = tmp_path / "bad"
    if case != "missing":
        make_adapter(base, folder, seed=2, r=32 if case == "rank" else 8)
    if case == "corrupt":
        _corrupt(folder)
    elif case == "target":
        _edit_config(folder, target_modules=["q_proj", "foo_proj"])
    elif case == "hidden":
        other = write_tiny_model(tmp_path / "wider", cfg=TINY_GQA.__class__(**{**TINY_GQA.__dict__, "hidden_size": 64}))
        make_adapter(other, folder, seed=2)
    elif case == "dora":
        _edit_config(folder, use_dora=True)
    elif case == "modules_to_save":
        _edit_config(folder, modules_to_save=["lm_head"])
    elif case == "embedding":
        _add_tensor(folder, "base_model.model.model.embed_tokens.lora_embedding_A", torch.zeros(8, 512))
    elif case.startswith("alpha"):
        _edit_config(folder, **{"alpha-nan": {"lora_alpha": float("nan")}, "alpha-inf": {"lora_alpha": float("inf")},
                                "alpha-huge": {"lora_alpha": 8e29}, "alpha-pattern-string": {"alpha_pattern": "q_proj"},
                                "alpha-pattern-nan": {"alpha_pattern": {"q_proj": float("nan")}}}[case])
    elif case == "target-number":
        _edit_config(folder, target_modules=[5])
    elif case == "rank-zero":
        tensors = {k: v[:0] if "lora_A" in k else v[:, :0] for k, v in load_file(str(folder / "adapter_model.safetensors")).items()}
        save_file(tensors, str(folder / "adapter_model.safetensors"))
    elif case == "nul-path":
        folder = tmp_path / "bad\x00adapter"
    elif case == "long-name":
        folder = tmp_path / ("x" * 300)
    llm = engine(base)
    with pytest.raises(AdapterError, match=message):
        llm.load_lora("bad", folder)
    assert llm.loras() == []
    # the engine goes on serving
    assert llm.generate(["hello"], SamplingParams(max_tokens=2))[0].outputs[0].token_ids


@pytest.fixture(scope="module")
def default_adapter(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.nn.Module]:
    """A rank-8 adapter on all seven projections of the embedded default model, and peft over the
    model's weights dequantized to fp32 (what `quantization="none"` runs)."""
    from ruvllm.loader import resolve_model
    from tests.reference import hf_reference

    torch.manual_seed(7)
    model = get_peft_model(hf_reference(resolve_model(None)),
                           LoraConfig(r=8, lora_alpha=16, target_modules=ALL, init_lora_weights=False))
    with torch.no_grad():  # peft's random B is large for a 576-wide model: keep the delta a nudge
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.mul_(0.05)
    folder = tmp_path_factory.mktemp("default-lora") / "a"
    model.save_pretrained(folder)
    return folder, model.eval()


def test_default_model_fp32_logits_match_peft(default_adapter: tuple[Path, torch.nn.Module]) -> None:
    folder, ref = default_adapter
    llm = LLM(enable_lora=True, max_loras=1, max_lora_rank=8, dtype="float32", quantization="none", num_blocks=64)
    llm.load_lora("a", folder)
    with torch.no_grad(), ref.disable_adapter():
        base_logits = peft_logits(ref, DEFAULT_PROMPT, DEFAULT_CONTINUATION)
    assert_default_model_follows(llm, "a", ref, base_logits, ATOL)


def test_default_precision_mixed_batch_equals_alone(default_adapter: tuple[Path, torch.nn.Module]) -> None:
    """The embedded default (Q4_1 codes, 8-bit activations) with the adapter beside the base."""
    folder, _ = default_adapter
    llm = LLM(enable_lora=True, max_loras=1, max_lora_rank=8)
    llm.load_lora("a", folder)
    prompts = ["The capital of France is", "Once upon a time", "def fibonacci(n):", "My favourite colour is"]
    names = ["a", None, "a", None]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    together = llm.generate(prompts, params, lora=names)
    llm.reset_prefix_cache()
    for p, name, out in zip(prompts, names, together):
        assert llm.generate([p], params, lora=name)[0].outputs[0].token_ids == out.outputs[0].token_ids
    plain = llm.generate(prompts, params)
    adapted = llm.generate(prompts, params, lora="a")
    assert any(p.outputs[0].token_ids != a.outputs[0].token_ids for p, a in zip(plain, adapted))


@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_quantized_base_mixed_batch_equals_alone(base: Path, tmp_path: Path, quantization: str) -> None:
    make_adapter(base, tmp_path / "a", seed=8)
    llm = engine(base, quantization=quantization)
    llm.load_lora("a", tmp_path / "a")
    prompts = [torch.randint(2, 500, (12 + i,), generator=torch.Generator().manual_seed(i)).tolist() for i in range(6)]
    names = ["a" if i % 2 else None for i in range(6)]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    together = llm.generate(prompts, params, lora=names)
    llm.reset_prefix_cache()
    for p, name, out in zip(prompts, names, together):
        assert llm.generate([p], params, lora=name)[0].outputs[0].token_ids == out.outputs[0].token_ids


def test_more_adapters_than_slots_take_turns(base: Path, tmp_path: Path) -> None:
    """4 adapters loaded, 2 slots: no step mixes more than 2, requests for the others wait for a
    slot, and every output is the request's alone. A fifth adapter is over --max-cpu-loras."""
    llm = engine(base, max_loras=2, max_cpu_loras=4)
    for i in range(5):
        make_adapter(base, tmp_path / f"a{i}", seed=40 + i)
    for i in range(4):
        llm.load_lora(f"a{i}", tmp_path / f"a{i}")
    with pytest.raises(AdapterError, match="max-cpu-loras"):
        llm.load_lora("a4", tmp_path / "a4")
    core = llm.core
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    prompts = [torch.randint(2, 500, (14,), generator=torch.Generator().manual_seed(60 + i)).tolist() for i in range(12)]
    names = [f"a{i % 4}" for i in range(12)]
    for i, (p, name) in enumerate(zip(prompts, names)):
        core.add_request(CoreRequest(f"t{i}", p, params, adapter=name))
    tokens: dict[str, list[int]] = {f"t{i}": [] for i in range(12)}
    while core.has_unfinished:
        for out in core.step():
            tokens[out.request_id] += out.new_token_ids
        assert len({r.adapter for r in core.scheduler.running}) <= 2
        assert len(core.executor.lora.resident()) <= 2
    for i, (p, name) in enumerate(zip(prompts, names)):
        assert llm.generate([p], params, lora=name)[0].outputs[0].token_ids == tokens[f"t{i}"]


def test_cpp_layer_loop_with_adapters_is_the_python_loop(base: Path, tmp_path: Path, monkeypatch) -> None:
    """A step with adapter rows runs in the C++ layer loop (the deltas called from C++ where the
    Python loop adds them): the generations are bitwise those of the Python loop."""
    from ruvllm.models.cpu_layer_loop import CpuLayerLoop

    llm = engine(base, dtype="float32")  # the C++ layer loop runs fp32 models only
    for i in range(2):
        make_adapter(base, tmp_path / f"a{i}", seed=70 + i, r=4 + 4 * i)
        llm.load_lora(f"a{i}", tmp_path / f"a{i}")
    calls = []
    real_call = CpuLayerLoop.__call__
    monkeypatch.setattr(CpuLayerLoop, "__call__", lambda self, *a, **k: calls.append(k) or real_call(self, *a, **k))
    prompts = [torch.randint(2, 500, (10 + 5 * i,), generator=torch.Generator().manual_seed(80 + i)).tolist() for i in range(6)]
    names = ["a0", "a1", None, "a0", None, "a1"]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=3)
    in_cpp = llm.generate(prompts, params, lora=names)
    assert calls, "the C++ loop must have run the adapter steps"
    model = llm.core.executor.runner.model
    model.__dict__["_loop"] = None  # the Python loop from here on
    llm.reset_prefix_cache()
    in_python = llm.generate(prompts, params, lora=names)
    for a, b in zip(in_cpp, in_python):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].logprobs == b.outputs[0].logprobs


def test_bf16_engine_with_an_adapter_follows_peft(base: Path, tmp_path: Path) -> None:
    """bf16 compute (the PyTorch-ops path of the deltas): within bf16's rounding of peft's fp32
    logits, and moved by the adapter as peft's are."""
    ref = make_adapter(base, tmp_path / "a", seed=90)
    llm = engine(base, dtype="bfloat16")
    llm.load_lora("a", tmp_path / "a")
    prompt, continuation, expected, base_logits = random_case(ref, 30, 8, seed=3)
    ours = our_logits(llm, "a", prompt, continuation, None).float()
    moved = (expected - base_logits).abs().max()
    assert (ours - expected).abs().max() < 0.1 * moved
    assert (ours.argmax(-1) == expected.argmax(-1)).float().mean() >= 0.9
