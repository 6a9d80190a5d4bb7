"""X-LoRA (issue 15): peft's X-LoRA models served through our scaling pass, classifier and mixed
adapter deltas, checked against peft itself (the oracle) on the same weights."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ruvllm import LLM, SamplingParams
from tests.engine_fixtures import TINY_GQA, write_tiny_model
from tests.lora_fixtures import make_adapter, make_xlora
from tests.reference import teacher_forced_logits

ATOL = 2e-4


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("xlora") / "base")


@pytest.fixture(scope="module")
def experts(base: Path) -> list[Path]:
    root = base.parent
    make_adapter(base, root / "e0", seed=11)
    make_adapter(base, root / "e1", seed=12, targets=["q_proj", "v_proj", "down_proj"], r=4)
    make_adapter(base, root / "e2", seed=13, targets=["o_proj", "gate_proj", "up_proj"], r=16, alpha=8)
    return [root / "e0", root / "e1", root / "e2"]


def engine(base: Path, **kw: object) -> LLM:
    kw.setdefault("num_blocks", 64)
    return LLM(str(base), enable_lora=True, max_loras=4, max_lora_rank=16, **kw)


def peft_logits(model: torch.nn.Module, prompt: list[int], continuation: list[int]) -> torch.Tensor:
    with torch.no_grad():
        full = model(torch.tensor([prompt + continuation])).logits[0].float()
    return full[len(prompt) - 1:]


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
    llm = engine(base)
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
