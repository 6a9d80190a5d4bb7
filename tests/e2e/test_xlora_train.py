"""`ruvllm xlora train`: trains a classifier over two adapters that each suit one kind of text
(peft, on the tiny model), writes a checkpoint that peft loads with the same logits as ours, and
routes held-out texts of each kind to their adapter. Bad input is one line and exit 1."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from typer.testing import CliRunner

from ruvllm import LLM
from ruvllm.cli import main as cli_main
from tests.engine_fixtures import write_tiny_model
from tests.lora_fixtures import ALL, hf_model
from tests.reference import teacher_forced_logits

if not any(g.name == "xlora" for g in cli_main.app.registered_groups):
    cli_main._register()

pytestmark = pytest.mark.usefixtures("wide_terminal")  # each message on one line


def _text(rng: random.Random, token: int) -> str:
    """Six random words, then the adapter's token six times: the kind of text that adapter suits."""
    return " ".join([f"t{rng.randrange(20, 500)}" for _ in range(6)] + [f"t{token}"] * 6)


def _train_lora(base: Path, out: Path, token: int, seed: int) -> None:
    torch.manual_seed(seed)
    model = get_peft_model(hf_model(base), LoraConfig(r=8, lora_alpha=16, target_modules=ALL))
    model.train()
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    gen = torch.Generator().manual_seed(seed)
    for _ in range(30):
        x = torch.randint(20, 500, (8, 12), generator=gen)
        x[:, 6:] = token
        labels = torch.full_like(x, -100)
        labels[:, 6:] = token
        loss = model(input_ids=x, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.save_pretrained(out)


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    root = tmp_path_factory.mktemp("xlora-train")
    base = write_tiny_model(root / "base")
    _train_lora(base, root / "sevens", 7, seed=1)
    _train_lora(base, root / "nines", 9, seed=2)
    rng = random.Random(0)
    lines = [{"text": _text(rng, 7 if i % 2 == 0 else 9), "adapter": "sevens" if i % 2 == 0 else "nines"}
             for i in range(60)]
    data = root / "data.jsonl"
    data.write_text("\n".join(json.dumps(line) for line in lines))
    return base, root, data


def test_train_writes_a_checkpoint_peft_and_ruvllm_read_alike(setup: tuple[Path, Path, Path]) -> None:
    base, root, data = setup
    out = root / "x"
    result = CliRunner().invoke(cli_main.app, [
        "xlora", "train", "--adapters", str(root / "sevens"), str(root / "nines"), "--data", str(data),
        "-o", str(out), "--model", str(base), "--epochs", "4", "--size", "32", "--lr", "3e-3", "--max-tokens", "12",
        "--routing-weight", "10"])
    assert result.exit_code == 0, result.output
    line = result.output.strip().splitlines()[-1]
    assert line.startswith(f"wrote {out} (X-LoRA over 2 adapters, 24 steps"), line
    accuracy = float(line.split("routing on 12 held-out texts: ")[1].split("%")[0])
    # 11 of 12 here; chance is 6 (the tiny random model's LM loss pulls against the routing term:
    # the routing figure that counts is benchmarks/xlora_routing.py's, on the real model)
    assert accuracy >= 75.0, line
    assert sorted(p.name for p in out.iterdir()) == ["README.md", "adapter_config.json", "adapter_model.safetensors"]

    model = hf_model(base)
    model.config.use_cache = False
    ref = PeftModel.from_pretrained(model, out).eval()
    llm = LLM(str(base), enable_lora=True, max_loras=2, num_blocks=32, dtype="float32")  # peft's fp32 logits
    llm.load_lora("x", out)
    prompt = [f"t{i}" for i in (33, 480, 57, 101, 260, 99)]
    ids = llm.tokenizer.encode(" ".join(prompt))
    with torch.no_grad():
        expected = ref(torch.tensor([ids + [7, 7, 9]])).logits[0, len(ids) - 1:].float()
    ours = teacher_forced_logits(llm.core.kv, llm.core.executor.runner, ids, [7, 7, 9], None, "x")
    assert (ours - expected).abs().max().item() < 2e-4


@pytest.mark.parametrize("args,needles", [
    (["--adapters", "A"], ["at least two LoRA adapters"]),
    (["--adapters", "NOPE", "NOPE2"], ["not a PEFT adapter folder"]),
    (["--adapters", "SEVENS", "NINES", "--depth", "0"], ["--depth is out of range"]),
    (["--adapters", "SEVENS", "NINES", "--data", "BADJSON"], ["data.bad:2: not JSON"]),
    (["--adapters", "SEVENS", "NINES", "--data", "BADLABEL"], ["label.jsonl:1: \"adapter\" must be one of sevens, nines"]),
])
def test_bad_input_is_one_line(setup: tuple[Path, Path, Path], tmp_path: Path, args: list[str],
                               needles: list[str]) -> None:
    base, root, data = setup
    (tmp_path / "data.bad").write_text('{"text": "t5"}\n{oops\n')
    (tmp_path / "label.jsonl").write_text('{"text": "t5", "adapter": "tens"}\n')
    subst = {"A": str(root / "sevens"), "SEVENS": str(root / "sevens"), "NINES": str(root / "nines"),
             "NOPE": str(tmp_path / "nope"), "NOPE2": str(tmp_path / "nope2"), "BADJSON": str(tmp_path / "data.bad"),
             "BADLABEL": str(tmp_path / "label.jsonl")}
    args = [subst.get(a, a) for a in args]
    if "--data" not in args:
        args += ["--data", str(data)]
    result = CliRunner().invoke(cli_main.app, ["xlora", "train", *args, "-o", str(tmp_path / "out"),
                                               "--model", str(base)])
    assert result.exit_code == 1, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), result.output
    for needle in needles:
        assert needle in lines[0], result.output
