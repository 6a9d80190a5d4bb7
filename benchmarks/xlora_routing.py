"""Does a trained X-LoRA classifier route each kind of text to the adapter made for it?

On the embedded default model (dequantized to float32, as transformers' model): one LoRA adapter
trained (peft, rank 8, all seven projections) per kind of text: prose from the novel, arithmetic
lines, and JSON records. Then `ruvllm xlora train`'s own training (lora/xlora_train.py) learns a
classifier over the three on a labelled mix, once per --routing-weights value (0: the causal-LM
loss alone, as peft trains), and the held-out texts of each kind are routed: the argmax of the mean
scaling over a text's tokens and the adapted modules. The goal: at least 90% to the right adapter.

    .venv/bin/python benchmarks/xlora_routing.py --per-kind 60 --routing-weights 1 0
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

KINDS = ("prose", "arithmetic", "json")
NOVEL = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "pride-and-prejudice.txt"


def texts_of(kind: str, n: int, rng: random.Random, novel: list[str]) -> list[str]:
    if kind == "prose":
        starts = rng.sample(range(len(novel) - 60), n)
        return [" ".join(novel[s:s + 45]) for s in starts]
    if kind == "arithmetic":
        ops = [("+", lambda a, b: a + b), ("-", lambda a, b: a - b), ("*", lambda a, b: a * b)]
        out = []
        for _ in range(n):
            parts = []
            for _ in range(6):
                sym, f = rng.choice(ops)
                a, b = rng.randrange(2, 99), rng.randrange(2, 99)
                parts.append(f"{a} {sym} {b} = {f(a, b)}.")
            out.append(" ".join(parts))
        return out
    names = [w.strip(".,;:!?\"'()") for w in novel if w[:1].isupper() and w.strip(".,;:!?\"'()").isalpha()]
    return [", ".join('{"name": "%s", "age": %d, "score": %d}' % (rng.choice(names), rng.randrange(18, 90),
                                                                   rng.randrange(0, 100)) for _ in range(3))
            for _ in range(n)]


def train_lora(base_fn, tokenizer, texts: list[str], out: Path, steps: int, seed: int) -> None:
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    model = get_peft_model(base_fn(), LoraConfig(r=8, lora_alpha=16, target_modules=[
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]))
    model.train()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=2e-3)
    rng = random.Random(seed)
    from ruvllm.lora.xlora_train import _encode

    for _ in range(steps):
        ids, mask = _encode(tokenizer, rng.sample(texts, 8), 64)
        loss = model(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100)).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.save_pretrained(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--per-kind", type=int, default=60, help="labelled texts of each kind (20%% held out)")
    ap.add_argument("--lora-steps", type=int, default=40)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--routing-weights", type=float, nargs="+", default=[1.0, 0.0])
    ap.add_argument("--novel", type=Path, default=NOVEL)
    args = ap.parse_args()

    from ruvllm.loader import load_tokenizer, resolve_model
    from ruvllm.lora.xlora_train import Example, XLoraTrainConfig, train_xlora, transformers_model

    src = resolve_model(None)
    tokenizer = load_tokenizer(src)
    novel = args.novel.read_text(encoding="utf-8").split()
    rng = random.Random(0)
    console = Console()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        adapters = []
        for i, kind in enumerate(KINDS):
            t = time.perf_counter()
            train_lora(lambda: transformers_model(src), tokenizer, texts_of(kind, 64, rng, novel), root / kind,
                       args.lora_steps, seed=i)
            console.print(f"adapter {kind}: {args.lora_steps} steps in {time.perf_counter() - t:.0f} s")
            adapters.append(root / kind)
        examples = [Example(text, i) for i, kind in enumerate(KINDS) for text in texts_of(kind, args.per_kind, rng, novel)]
        table = Table(title=f"X-LoRA routing on held-out texts: default model, {len(KINDS)} rank-8 adapters, "
                            f"{args.per_kind} labelled texts a kind (20% held out), {args.epochs} epochs")
        for col in ("routing weight", "steps", "loss first -> last", *KINDS, "all", "train s"):
            table.add_column(col, justify="right")
        for w in args.routing_weights:
            t = time.perf_counter()
            result = train_xlora(transformers_model(src), tokenizer, adapters, examples, root / f"x{w}",
                                 XLoraTrainConfig(epochs=args.epochs, routing_weight=w, max_tokens=64))
            per = [result.per_label.get(i, (0, 0)) for i in range(len(KINDS))]
            table.add_row(f"{w:g}", str(result.steps), f"{result.first_loss:.3f} -> {result.last_loss:.3f}",
                          *(f"{ok}/{n}" for ok, n in per), f"{100 * (result.routing_accuracy or 0):.1f}%",
                          f"{time.perf_counter() - t:.0f}")
        console.print(table)


if __name__ == "__main__":
    sys.exit(main())
