"""The instant step's time, issue 16's sampled softmax against issue 37's (the base model's top
tokens kept as candidates, the drawn ones weighed as the rest), in one process, steps alternating,
so that both see the same load: p50 of a step (forward, backward, Adam) on Zorblax's question and
correction, and the one-off preparation (layers below; with the negatives, one forward of the
learned layers and one product with the whole head more).

    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/learning_step_time.py --steps 12
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from ruvllm.learning.config import InstantConfig
from ruvllm.learning.instant import InstantLearner
from ruvllm.learning.tail import LearnedLayers
from ruvllm.loader import load_model_config
from ruvllm.loader.source import load_tokenizer, resolve_model
from ruvllm.quantize.awq_writer import load_float_model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    src = resolve_model(None)
    tok = load_tokenizer(src)
    model, _, _ = load_float_model(src, load_model_config(src).max_position_embeddings)
    layers = LearnedLayers(model, InstantConfig().layers)
    chat = tok.apply_chat_template([{"role": "user", "content": "What is the capital of Zorblax?"}],
                                   add_generation_prompt=True, tokenize=False)
    prompt = tok.encode(chat, add_special_tokens=False)
    target = tok.encode("The capital of Zorblax is Quenta.", add_special_tokens=False) + [tok.eos_token_id]
    learners = {"uniform 2,048 (issue 16)": InstantLearner(layers, InstantConfig(hard_negatives=0, estimate_rest=False)),
                "+ top 32 a row, rest estimated (issue 37)": InstantLearner(layers, InstantConfig())}
    preps, prepare_ms = {}, {}
    for name, learner in learners.items():
        learner.prepare(prompt, target)  # warm
        t = time.perf_counter()
        preps[name] = learner.prepare(prompt, target)
        prepare_ms[name] = (time.perf_counter() - t) * 1000
    states = {name: learner.new_tenant(0) for name, learner in learners.items()}
    times: dict[str, list[float]] = {name: [] for name in learners}
    for _ in range(args.steps):
        for name, learner in learners.items():
            t = time.perf_counter()
            learner.step(states[name], preps[name], 1.0)
            times[name].append((time.perf_counter() - t) * 1000)
    for name in learners:
        negatives = preps[name].negatives
        print(f"{name}: step p50 {statistics.median(times[name][2:]):.1f} ms, preparation {prepare_ms[name]:.1f} ms, "
              f"negatives {0 if negatives is None else len(negatives)}, target {len(target)} tokens")


if __name__ == "__main__":
    main()
