"""The instant step's loss, step by step, on the learner's own float32 model (no engine, no
sampling): for each fact of a file, --events steps on the fact's question and correction (under the
chat template), and after each one the loss the step saw, the full softmax's worst target token
(nats) and the probability that sampling at T=0.7 reproduces the correction word for word; at the
end that probability for each paraphrase. What showed why a fact held or not (docs/learning.md,
issue 37): a loss the step sees that is far below the full softmax's.

    .venv/bin/python benchmarks/teach_facts_probe.py --cfg '{"hard_negatives": 0, "estimate_rest": false}'
    .venv/bin/python benchmarks/teach_facts_probe.py --cfg '{"candidates": 0}'
"""
import argparse
import json
import math
import time
from pathlib import Path

import torch
from ruvllm.loader.source import resolve_model, load_tokenizer
from ruvllm.loader import load_model_config
from ruvllm.quantize.awq_writer import load_float_model
from ruvllm.learning.tail import LearnedLayers
from ruvllm.learning.instant import InstantLearner
from ruvllm.learning.config import InstantConfig

ap = argparse.ArgumentParser()
ap.add_argument("--facts", default=str(Path(__file__).resolve().parent / "data" / "tuning_facts.json"))
ap.add_argument("--events", type=int, default=10)
ap.add_argument("--cfg", default="{}", help="InstantConfig fields, as JSON")
args = ap.parse_args()
src = resolve_model(None)
tok = load_tokenizer(src)
model, mc, _ = load_float_model(src, load_model_config(src).max_position_embeddings)
cfg = InstantConfig(**json.loads(args.cfg))
layers = LearnedLayers(model, cfg.layers)
inst = InstantLearner(layers, cfg)
eos = tok.convert_tokens_to_ids("<|im_end|>")
facts = json.load(open(args.facts))["facts"]

def prompt_ids(q):
    return tok.encode(tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False), add_special_tokens=False)

@torch.no_grad()
def metrics(lora, prompt, target):
    prep = inst.prepare(prompt, target, "full")
    out = layers.forward(prep.h, torch.arange(len(prompt) + len(target)), lora)
    logits = out[len(prompt) - 1:-1] @ layers.head.t()
    t = torch.tensor(target)
    nll = -logits.log_softmax(-1).gather(1, t[:, None]).squeeze(1)
    nll07 = -(logits / 0.7).log_softmax(-1).gather(1, t[:, None]).squeeze(1)
    return float(nll.mean()), float(nll.max()), math.exp(-float(nll07.sum()))

for i, f in enumerate(facts):
    target = tok.encode(f["correction"], add_special_tokens=False) + [eos]
    pq = prompt_ids(f["question"])
    pps = [prompt_ids(p) for p in f["paraphrases"]]
    st = inst.new_tenant(seed=i)
    prep = inst.prepare(pq, target)
    line = []
    t0 = time.perf_counter()
    for e in range(args.events):
        timing = inst.step(st, prep, 1.0)
        m = metrics(st.lora, pq, target)
        line.append(f"{timing.loss:.2f}/{m[1]:.2f}/{m[2]:.2f}")
    dt = (time.perf_counter() - t0)
    mp = [metrics(st.lora, p, target) for p in pps]
    print(f"[{f['shape']}] steps {st.steps} q: mean {m[0]:.3f} max {m[1]:.3f} pseq0.7 {m[2]:.3f} | para pseq0.7 "
          + " ".join(f"{x[2]:.3f}" for x in mp) + f" | {dt:.1f}s")
    print("   per event loss/fullmax/pseq:", " ".join(line))
