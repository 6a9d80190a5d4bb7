"""The instant step's time (issue 37): the learned layers in float32 (a dequantized copy, F.linear)
against the served packed weights (the engine's quantized matmul forward, our C++ input gradient
backward: learning/packed_linear.py), in one process, steps alternating so that both see the same
load: p50 of a step (forward, backward, Adam) on Zorblax's question and correction, for each context
form, and the one-off preparation (layers below; the hard negatives' pass).

    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/learning_step_time.py --steps 24
    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/learning_step_time.py --memory   # RSS of each form
    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/learning_step_time.py --profile packed/full
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/learning_step_time.py --threads 1 --batch 4

--batch N (issue 37 item 3): N events one step each against the same N in one batched step
(`InstantLearner.step_events`), packed weights, full context, alternating: ms per event.

--memory runs each form in a fresh process of its own (so one's pages are not the other's) and
reports its resident set after the model is loaded and one step taken.

--update: the whole update as `ruvllm serve --learn` makes it (the default method: the KL term toward
the base on the tenant's everyday completions, the background pass after each event), through
`Learner.feedback` on the offline engine: one tenant per arm, arms alternating event by event. Arms:
each context form with the KL term in the step, its completions one by one (the learner before
this cut: nothing computed ahead) and as the learner is now (the term computed ahead by the
background pass, `Learner._ahead`, its completions batched with their shared rows once). Reports the
step, the publish (PEFT folder written, loaded into the engine) and the pass's time (pull, publish,
the term ahead: off the feedback's path).

    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/learning_step_time.py --update --steps 16

--cut: the frozen step on packed weights (no KL term: the update's own step) as it was before session
17 (the packed matmul and each micro-LoRA delta as separate autograd nodes), as session 17 left it
(its fused projection, 8-bit backward and element-wise ops one node each; its kernel source at
--kernel-rev, its element-wise backward, attention and LoRA pieces in torch ops: rebuilt here), then
session 18's levers one by one: the 8-bit path of the quantized matmul (both kernel sources built
alone), the element-wise backward in C++ (learning/csrc/element_grad.cpp), the attention in C++
(learning/row_attention.py), the LoRA pieces in C++ (learning/csrc/micro_lora.cpp), and the default as
the learner runs it (the tree's extension): arms alternating step by step; CPU time beside wall
time (at one thread: the step's own work under load). Session 17's figures for its own levers are in
docs/learning.md.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/learning_step_time.py --cut --threads 1 --steps 120

--update's arms include the default as session 17 left it (--kernel-rev's kernel, the element-wise
backward and LoRA pieces in torch ops, causal_attention) against the tree's, alternating event by event.

--update --candidates-ahead: the default alone against itself with the sampled softmax's drawn
candidates drawn and gathered in the step and its exact candidates found in the step (the learner
before session 18's helper-47), where the default makes the draws ahead in the background pass
(learning/candidates.py) and finds the exact ones once a pair (Prepared.exact): each arm its own pool
of the same seed, alternating event by event. The other --update arms draw in the step.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/learning_step_time.py --update --candidates-ahead \
        --contexts frozen --threads 1 --steps 16

--whole: the update's own step (frozen, packed, no KL term) as session 19 left it (the learned layers
one C++ call each way, learning/whole_layers.py; the sampled softmax's logits one node of our C++,
learning/sampled_logits.py) against session 18's (autograd's graph of the layers, torch's products),
alternating step by step; with --candidates-ahead, the drawn candidates gathered before each step
and the caches flushed (64 MB written) between, as the background pass and serving leave them.
--update --whole: the same two through the Learner (the default method), event by event.
Session 20's arm (the default now) beside them: the step with no autograd graph (the learned layers'
calls by hand, the sampled softmax's loss and gradient one C++ call: InstantLearner._by_hand) and Adam
as one call of its fused kernel (instant.adam_step); the arms before it take the graph and
Optimizer.step(). The kernels' own changes of session 20 (the attention, the rows' quantization) are
in every arm. --since-19: session 19's arm and the default alone.
Session 21's arm (the default now): the KL term's completions, in the background pass's term
computed ahead (and in a coalesced step's), through the learned layers' C++ calls as sequences of one
pass, the term differentiated from their rows alone (anchor.kl_grads, InstantLearner._many_by_hand);
session 20's arm runs them through autograd's graph of the layers (forward_many), as before (its
attention now our C++ node too: session 21 made forward_many's the one-sequence pass's).
--since-20: session 20's arm and the default alone. --coalesce N: each arm's turn is N feedback events
on N completions learned as one backlog (Learner.feedback_many: one step over them, the KL term
computed in the step, as the server does when behind: nothing computed ahead), then the background
pass; the step's time is reported per event.

    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/learning_step_time.py --update --whole --contexts frozen \
        --threads 2 --steps 32
    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/learning_step_time.py --update --whole --since-20 \
        --contexts frozen --threads 2 --steps 16 --coalesce 4

    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/learning_step_time.py --whole --candidates-ahead --threads 2 \
        --steps 60 --since-19

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/learning_step_time.py --whole --candidates-ahead --threads 1 \
        --steps 60
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/learning_step_time.py --update --whole --contexts frozen --threads 1

--phases: where a step with the KL term in it goes (per-phase timers, packed weights, each context
form; arms alternating): the feedback's forward (its rows through the learned layers, the sampled
softmax), the KL term's forward (two everyday completions, one by one as before and batched with
their shared rows once: `anchor.kl_mean`), the backward of both, Adam.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/learning_step_time.py --phases --threads 1 --steps 16
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import statistics
import subprocess
import sys
import time

import torch

from ruvllm.learning.config import InstantConfig
from ruvllm.learning.instant import InstantLearner
from ruvllm.learning.tail import LearnedLayers, load_learning_model
from ruvllm.loader.source import load_tokenizer, resolve_model

QUESTION = "What is the capital of Zorblax?"
CORRECTION = "The capital of Zorblax is Quenta."


def _time_arms(runs: dict, steps: int, clock, around=None, before=None):  # noqa: ANN001, ANN202
    """Each arm's (learner, prepared pair, tenant) stepped `steps` times, the arms alternating and their
    order reversed every other round: the wall and `clock`'s CPU time of each step (ms), and the load
    average after each round. `before(learner)` runs untimed before a step, `around(name)` is a context
    the step runs in."""
    times: dict[str, list[float]] = {name: [] for name in runs}
    cpu: dict[str, list[float]] = {name: [] for name in runs}
    loads = []
    for i in range(steps):
        for name in runs if i % 2 == 0 else list(runs)[::-1]:
            learner, prep, state = runs[name]
            if before is not None:
                before(learner)
            with around(name) if around is not None else contextlib.nullcontext():
                t, c = time.perf_counter(), clock()
                learner.step(state, prep, 1.0)
                times[name].append((time.perf_counter() - t) * 1000)
                cpu[name].append((clock() - c) * 1000)
        loads.append(os.getloadavg()[0])
    return times, cpu, loads


def _step_table(times: dict[str, list[float]], cpu: dict[str, list[float]], loads: list[float], args,  # noqa: ANN001
                prompt_len: int, target_len: int, cpu_label: str) -> None:
    """The arms' step times as a table (the first 2 steps an arm dropped: warm-up)."""
    print(f"load average {min(loads):.2f}-{max(loads):.2f}, {args.threads} threads, packed weights, frozen context, "
          f"{args.steps} steps an arm (first 2 dropped), arms alternating, prompt {prompt_len} + target "
          f"{target_len} tokens")
    print(f"| the step | p50 | p90 | CPU p50 ({cpu_label}) |")
    print("|---|---|---|---|")
    for name, v in times.items():
        print(f"| {name} | {statistics.median(v[2:]):.1f} ms | {statistics.quantiles(v[2:], n=10)[-1]:.1f} ms | "
              f"{statistics.median(cpu[name][2:]):.1f} ms |")


def _rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def _pair(src) -> tuple[list[int], list[int]]:  # noqa: ANN001
    tok = load_tokenizer(src)
    chat = tok.apply_chat_template([{"role": "user", "content": QUESTION}], add_generation_prompt=True, tokenize=False)
    prompt = tok.encode(chat, add_special_tokens=False)
    return prompt, tok.encode(CORRECTION, add_special_tokens=False) + [tok.eos_token_id]


def _memory_child(form: str) -> None:
    src = resolve_model(None)
    before = _rss_mib()
    model, cfg = load_learning_model(src, packed=form == "packed")
    learner = InstantLearner(LearnedLayers(model, InstantConfig().layers), InstantConfig())
    prompt, target = _pair(src)
    learner.step(learner.new_tenant(0), learner.prepare(prompt, target), 1.0)
    print(f"{form}: RSS {_rss_mib():.0f} MiB after loading and one step (process start {before:.0f} MiB)")


def _batched(src, prompt: list[int], target: list[int], args: argparse.Namespace) -> None:  # noqa: ANN001
    learner = InstantLearner(LearnedLayers(load_learning_model(src)[0], InstantConfig().layers), InstantConfig())
    prep = learner.prepare(prompt, target)
    one, many = learner.new_tenant(0), learner.new_tenant(1)
    per_event: dict[str, list[float]] = {"one step an event": [], f"one step over {args.batch} events": []}
    for _ in range(args.steps):
        t = time.perf_counter()
        for _ in range(args.batch):
            learner.step(one, prep, 1.0)
        per_event["one step an event"].append((time.perf_counter() - t) * 1000 / args.batch)
        t = time.perf_counter()
        learner.step_events(many, [(prep, 1.0)] * args.batch)
        per_event[f"one step over {args.batch} events"].append((time.perf_counter() - t) * 1000 / args.batch)
    print(f"load average {os.getloadavg()[0]:.2f}, {args.threads} threads, packed weights, full context, "
          f"{args.steps} rounds (first 2 dropped)")
    for name, v in per_event.items():
        print(f"| {name} | {statistics.median(v[2:]):.1f} ms an event |")


def _update(args: argparse.Namespace) -> None:
    """The whole update through the Learner, arms alternating event by event (see the docstring)."""
    import dataclasses
    import tempfile

    import ruvllm.learning.learner as learner_module
    from ruvllm import LLM, SamplingParams
    from ruvllm.learning.anchor import kl_mean, kl_to_base
    from ruvllm.learning.candidates import CandidatePool
    from ruvllm.learning.config import LearningConfig

    def one_by_one(layers, lora, anchors, drawn, gen):  # noqa: ANN001, ANN202
        return sum(kl_to_base(layers, lora, a, drawn, gen) for a in anchors) / len(anchors)

    def exact_in_step(instant, rows, labels, negatives=None, exact=None):  # noqa: ANN001, ANN202
        return InstantLearner._logits(instant, rows, labels, negatives)

    everyday = ["Write two sentences about the sea.", "What is a good way to learn a new language?",
                "Summarise the plot of a love story in three sentences.", "Give me a tip for cooking rice."]
    questions = [QUESTION, "Who painted the ceiling of the Zorblax chapel?", "What is the Zorblax river called?",
                 "When was Zorblax founded?", "What do people in Zorblax eat?", "How tall is Mount Zorblax?",
                 "What language is spoken in Zorblax?", "Who rules Zorblax?"]
    n = max(1, args.coalesce)
    assert n <= len(questions), f"--coalesce: at most {len(questions)}"
    from ruvllm.learning.learner import FeedbackEvent
    llm = LLM(enable_lora=True, max_loras=4, max_lora_rank=8, max_cpu_loras=32)
    # (context, the term ahead, the quantized matmul at --kernel-rev): session 18's kernel against the
    # one before it on the default method
    # (..., the drawn candidates made ahead): the arms before session 18's helper-47 draw them in the
    # step; --candidates-ahead: the default against itself with them drawn in the step, alone
    # (..., the learned layers as one C++ call each way): --whole: the default against itself with
    # them as autograd's graph (session 18's learner), alone; every other arm takes the call
    # (..., whole): 0 the learned layers as autograd's graph (session 18), 1 one C++ call each way
    # under the loss's graph and Optimizer.step (session 19), 2 no graph and Adam's one call (session
    # 20, the default)
    # (..., whole): ... 3 the KL term's completions through the layers' C++ calls too (session 21, the default)
    if args.whole:
        arms = [(context, True, False, True, whole) for context in args.contexts.split(",")
                for whole in ((2, 3) if args.since_20 else (1, 2, 3) if args.since_19 else (0, 1, 2, 3))]
    elif args.candidates_ahead:
        arms = [(context, True, False, drawn, 3) for context in args.contexts.split(",") for drawn in (False, True)]
    else:
        arms = [(context, ahead, old, ahead and not old, 3) for context in args.contexts.split(",")
                for ahead, old in ((False, False), (True, True), (True, False))]
    matmuls = {True: _kernel_at(args.kernel_rev), False: None}
    from ruvllm.cpu_build import kernels

    old_ops = _session17_ops(kernels())
    with tempfile.TemporaryDirectory() as tmp:
        learner = llm.enable_learning(LearningConfig(root=tmp, threads=args.threads))
        base = learner.config
        asked = {}
        # each arm its own pool of drawn candidates (the same seed: the same draws step by step), none
        # kept ahead where the arm draws them in the step, so no arm takes another's batches
        pools = {arm: CandidatePool(learner.layers.head, base.instant.seed,
                                    base.instant.candidates_ahead if arm[3] else 0) for arm in arms}
        plan = learner.layers._whole  # (restored after the arms: the learner as it runs)
        for arm in arms:
            context, ahead, old, drawn, whole = arm
            tenant = f"{context}-{'ahead' if ahead else 'inline'}{'-old' if old else ''}{'-drawn' if drawn else ''}" \
                     f"-{whole}"
            llm.chat([[{"role": "user", "content": q}] for q in everyday], SamplingParams(temperature=0, max_tokens=48),
                     tenant=tenant)
            asked[arm] = tenant, llm.chat([[{"role": "user", "content": q}] for q in questions[:n]],
                                          SamplingParams(temperature=0, max_tokens=16), tenant=tenant)
        step: dict = {arm: [] for arm in arms}
        publish: dict = {arm: [] for arm in arms}
        passes: dict = {arm: [] for arm in arms}
        loads = []
        for i in range(args.steps):
            for arm in arms if i % 2 == 0 else arms[::-1]:
                context, ahead, old, drawn, whole = arm
                tenant, out = asked[arm]
                learner.layers._whole = plan if whole and not old else None
                if not whole:  # session 18's sampled softmax: every drawn column, torch's products
                    learner.instant._logits = functools.partial(_session18_logits, learner.instant)
                learner.instant.graphless = whole >= 2
                learner.instant.graphless_kl = whole == 3
                learner.instant.candidates = pools[arm]
                if not drawn:  # before: the exact candidates found in the step too, not once a pair
                    learner.instant._logits = functools.partial(exact_in_step, learner.instant)
                instant = dataclasses.replace(base.instant, context=context)
                learner.config = dataclasses.replace(base, instant=instant)
                learner.instant.config = instant
                # the learner before: the completions' KL one by one, no rows shared
                learner_module.kl_mean = kl_mean if ahead else one_by_one
                with _matmul(matmuls[old]), _ops(learner.layers, old_ops if old else None), _adam(whole >= 2):
                    if n == 1:
                        result = llm.feedback(out[0].request_id, -1.0, CORRECTION, tenant=tenant)
                    else:  # a backlog: one step over the n events, the KL term in it (_ahead skipped, below)
                        results = [r for _, r in learner.feedback_many(
                            [FeedbackEvent(o.request_id, tenant, -1.0, CORRECTION) for o in out])]
                        assert all(not isinstance(r, Exception) for r in results), results
                        assert all(r.events == n for r in results), [r.events for r in results]
                        result = results[0]
                learner_module.kl_mean = kl_mean
                learner.instant.__dict__.pop("_logits", None)
                step[arm].append(result.step_ms / n)
                publish[arm].append(result.publish_ms)
                if not ahead or n > 1:  # the term in the step, never computed ahead (a backlog: a step coming)
                    learner._ahead = lambda scope: None
                t = time.perf_counter()
                with _matmul(matmuls[old]), _ops(learner.layers, old_ops if old else None):
                    learner.consolidate()  # as the server's background loop does after each update
                passes[arm].append((time.perf_counter() - t) * 1000)
                learner.__dict__.pop("_ahead", None)
            loads.append(os.getloadavg()[0])
    print(f"load average {min(loads):.2f}-{max(loads):.2f}, {args.threads} threads, {args.steps} turns an arm "
          f"(first 2 dropped), {n} event(s) a turn{' in one step (the step per event)' if n > 1 else ''}, KL term on "
          f"(weight {base.instant.kl_weight:g}, {base.instant.kl_samples} completions)")
    print("| context / the KL term / the drawn candidates | update step p50 | p90 | publish p50 | "
          "background pass p50 (off the path) |")
    print("|---|---|---|---|---|")
    for arm in arms:
        t = step[arm][2:]
        what = "computed ahead, batched" if arm[1] else "before: in the step, one by one"
        what += f" (session 17: the kernel at {args.kernel_rev}, the rest in torch ops)" if arm[2] else ""
        what += " / made ahead (the default)" if arm[3] else " / drawn in the step"
        what += "" if arm[2] else [" / the learned layers as autograd's graph (session 18)",
                                   " / the learned layers one C++ call each way, the loss's graph (session 19)",
                                   " / no graph, Adam one call, the KL term's layers as autograd's graph (session 20)",
                                   " / no graph, the KL term's layers too (session 21, the default)"][arm[4]]
        print(f"| {arm[0]} / {what} | {statistics.median(t):.1f} ms | "
              f"{statistics.quantiles(t, n=10)[-1]:.1f} ms | {statistics.median(publish[arm][2:]):.1f} ms | "
              f"{statistics.median(passes[arm][2:]):.1f} ms |")


def _phases(src, prompt: list[int], target: list[int], args: argparse.Namespace) -> None:  # noqa: ANN001
    """Per-phase timers of a step with the KL term in it (see the docstring)."""
    import torch.nn.functional as F

    from ruvllm.learning.anchor import kl_mean, kl_to_base, make_anchor, shared_rows

    tok = load_tokenizer(src)
    everyday = [("Write two sentences about the sea.", "The sea stretches endlessly under the sky, its waves rolling "
                 "in a steady rhythm against the shore. Its deep blue waters hold countless creatures and secrets."),
                ("Give me a tip for cooking rice.", "Rinse the rice in cold water until the water runs clear, then use "
                 "about one and a half cups of water for every cup of rice and let it rest after cooking.")]
    layers = LearnedLayers(load_learning_model(src)[0], InstantConfig().layers)
    arms = {}
    for context in args.contexts.split(","):
        for kl in ("one by one", "batched"):
            learner = InstantLearner(layers, InstantConfig(context=context))
            arms[(context, kl)] = learner, learner.prepare(prompt, target), learner.new_tenant(0)
    c = InstantConfig()
    anchors = []
    for q, a in everyday:
        chat = tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False)
        prep = arms[next(iter(arms))][0].prepare(tok.encode(chat, add_special_tokens=False),
                                                 tok.encode(a, add_special_tokens=False), "full")
        anchors.append(make_anchor(layers, prep, c.kl_top))
    gen = torch.Generator().manual_seed(1)
    phases = ("feedback forward", "KL forward", "backward", "Adam", "step")
    times: dict = {arm: {p: [] for p in phases} for arm in arms}
    for i in range(args.steps):
        for arm in arms if i % 2 == 0 else list(arms)[::-1]:
            learner, prep, state = arms[arm]
            t0 = time.perf_counter()
            logits, index = learner._logits(learner._rows(prep, state.lora), torch.tensor(prep.target), prep.negatives)
            loss = F.cross_entropy(logits, index)
            t1 = time.perf_counter()
            if arm[1] == "batched":
                kl = kl_mean(layers, state.lora, anchors, c.candidates, gen)
            else:
                kl = sum(kl_to_base(layers, state.lora, a, c.candidates, gen) for a in anchors) / len(anchors)
            loss = loss + c.kl_weight * kl
            t2 = time.perf_counter()
            state.opt.zero_grad()
            loss.backward()
            t3 = time.perf_counter()
            state.opt.step()
            t4 = time.perf_counter()
            for p, v in zip(phases, (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t4 - t0)):
                times[arm][p].append(v * 1000)
    rows = [a.prep.prompt_len + len(a.prep.target) for a in anchors]
    print(f"load average {os.getloadavg()[0]:.2f} {os.getloadavg()[1]:.2f}, {args.threads} threads, {args.steps} steps "
          f"an arm (first 2 dropped); feedback: prompt {len(prompt)} + target {len(target)} rows; KL: {rows} rows, "
          f"{shared_rows([a.prep.h for a in anchors])} shared at their start")
    print("| context / KL completions | " + " | ".join(phases) + " |")
    print("|---" * (len(phases) + 1) + "|")
    for arm, by in times.items():
        print(f"| {arm[0]} / {arm[1]} | " + " | ".join(f"{statistics.median(by[p][2:]):.1f} ms" for p in phases) + " |")


def _session16_linear(layers: LearnedLayers, lora):  # noqa: ANN001, ANN202
    """The learned layers' linear hook as it was before session 17 (for --cut's "before" arm): the
    packed matmul as its own autograd node, then each learned piece's delta in five more (two
    products, the scale, the pad to the fused width, the add)."""
    import torch.nn.functional as F

    from ruvllm.learning.packed_linear import packed_linear
    from ruvllm.lora.peft_adapter import projection_shape
    from ruvllm.lora.slots import FUSED

    def linear(module, x):  # noqa: ANN001, ANN202
        y = packed_linear(x, module._kernel_weight, module.bias)
        where = layers._projections.get(id(module))
        if lora is None or where is None:
            return y
        lo = 0
        for t in FUSED[where[1]]:
            width = projection_shape(layers.cfg, t)[1]
            delta = lora.delta(where[0], t, x)
            if delta is not None:
                y = y + F.pad(delta, (lo, y.shape[-1] - lo - width))
            lo += width
        return y
    return linear


def _cut(src, prompt: list[int], target: list[int], args: argparse.Namespace) -> None:  # noqa: ANN001
    """--cut: session 17's changes to the step, arm by arm (see the docstring)."""
    from ruvllm.layers.ops import torch_ops

    model = load_learning_model(src)[0]
    n = InstantConfig().layers
    # (each arm its own LearnedLayers over the one model: the before arm's linear hook replaced)
    ref = torch_ops()  # the torch reference's element-wise ops, as before session 17
    before = LearnedLayers(model, n, "float32", ref)
    before._linear_for = lambda lora: _session16_linear(before, lora)
    from ruvllm.cpu_build import kernels

    session17 = (f"session 17's default (the kernel at {args.kernel_rev}; element-wise backward, attention, "
                 "LoRA pieces in torch ops)")
    kernel18 = "+ session 18's 8-bit kernel"
    backward18 = "+ element-wise backward in C++"
    attention18 = "+ attention in C++"
    lora18 = "+ micro-LoRA pieces in C++ (session 18's default)"

    def layers_as(ops17: bool, attention17: bool, lora17: bool) -> LearnedLayers:
        layers = LearnedLayers(model, n, ops=_session17_ops(kernels()) if ops17 else None, whole=False)
        if attention17:
            layers._ext = None  # (its attention: causal_attention's torch ops, as before session 18)
        if lora17:
            layers._linear_for = lambda lora: _session17_linear(layers, lora)
        return layers
    arms = {"before (session 16)": before,
            session17: layers_as(True, True, True),
            kernel18: layers_as(True, True, True),
            backward18: layers_as(False, True, True),
            attention18: layers_as(False, False, True),
            lora18: layers_as(False, False, False),
            "session 18 (the kernels as built in the tree)": LearnedLayers(model, n, whole=False),
            "session 19, the default (the learned layers one C++ call each way, the drawn candidates pooled)":
                LearnedLayers(model, n)}
    # The quantized matmul built alone (as benchmarks/quant_matmul_rows.py --compare-with does) for the
    # arms that compare its source: as it was at --kernel-rev, and as it is in the tree. Alone, both
    # old and new: the same source ran its 4-bit path up to 7% apart built alone and built into the
    # extension with the other kernels (code layout, docs/learning.md "Session 18"), so only two lone
    # builds compare the sources. The last arm runs the tree's extension as the learner does.
    tree = _kernel_at(None)
    matmuls = {session17: _kernel_at(args.kernel_rev),
               **{arm: tree for arm in (kernel18, backward18, attention18, lora18)}}
    runs = {}
    for name, layers in arms.items():
        learner = InstantLearner(layers, InstantConfig())
        if not layers._whole:  # (the sessions before 19: every drawn column, torch's products)
            learner._logits = functools.partial(_session18_logits, learner)
        runs[name] = learner, learner.prepare(prompt, target), learner.new_tenant(0)
    times, cpu, loads = _time_arms(runs, args.steps, time.process_time, around=lambda name: _matmul(matmuls.get(name)))
    _step_table(times, cpu, loads, args, len(prompt), len(target), "all threads")


def _session17_linear(layers: LearnedLayers, lora):  # noqa: ANN001, ANN202
    """The learned layers' linear hook with session 17's fused projection (for --cut's before arms):
    one autograd node, its micro-LoRA pieces in torch ops (two products and a slice forward, four
    products, two scalings and a slice backward; session 18 made each piece one C++ call a way)."""
    import torch.nn.functional as F

    from ruvllm.learning.packed_linear import grad_input
    from ruvllm.lora.peft_adapter import projection_shape
    from ruvllm.lora.slots import FUSED
    from ruvllm.quant import cpu_matmul

    class Fused(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, w, wt, bias, scaling, spans, *ab):  # noqa: ANN001, ANN205
            y = cpu_matmul.matmul(x, w)
            if bias is not None:
                y += bias
            us = []
            for (lo, hi), a, b in zip(spans, ab[0::2], ab[1::2]):
                u = x @ a.t()
                y[:, lo:hi].addmm_(u, b.t(), alpha=scaling)
                us.append(u)
            ctx.save_for_backward(x, *ab, *us)
            ctx.w, ctx.wt, ctx.scaling, ctx.spans = w, wt, scaling, spans
            return y

        @staticmethod
        def backward(ctx, dy):  # noqa: ANN001, ANN205
            x, *rest = ctx.saved_tensors
            n, s = len(ctx.spans), ctx.scaling
            ab, us = rest[:2 * n], rest[2 * n:]
            dy = dy.contiguous()
            dx = grad_input(dy, ctx.w, ctx.wt) if ctx.needs_input_grad[0] else None
            grads = []
            for i, (lo, hi) in enumerate(ctx.spans):
                a, b, u = ab[2 * i], ab[2 * i + 1], us[i]
                d = dy[:, lo:hi]
                g = d @ b
                if dx is not None:
                    dx.addmm_(g, a, alpha=s)
                grads.append(g.t() @ x * s if ctx.needs_input_grad[6 + 2 * i] else None)
                grads.append(d.t() @ u * s if ctx.needs_input_grad[7 + 2 * i] else None)
            return (dx, None, None, None, None, None, *grads)

    def linear(module, x):  # noqa: ANN001, ANN202
        where = layers._projections.get(id(module)) if lora is not None else None
        pieces, lo = [], 0
        for t in FUSED[where[1]] if where else ():
            width = projection_shape(layers.cfg, t)[1]
            if (pair := lora.weights.get((where[0], t))) is not None:
                pieces.append(((lo, lo + width), pair))
            lo += width
        packed = getattr(module, "_kernel_weight", None)
        if packed is None:
            return F.linear(x, module.weight, module.bias)
        return Fused.apply(x, packed, layers._transposed.get(id(module)), module.bias, lora.scaling if lora else 1.0,
                           tuple(span for span, _ in pieces), *[t for _, pair in pieces for t in pair])
    return linear


def _session17_ops(ext):  # noqa: ANN001, ANN202
    """learning/fused_ops.py's learner ops as session 17 left them (for the before arms): our kernels
    forward, each backward written out in torch ops (session 18 made those one C++ call each)."""
    from torch.autograd import Function

    from ruvllm.layers.ops import LayerOps, _torch_rope
    from ruvllm.learning.fused_ops import learner_ops

    def rms_backward(dh, s, weight, eps):  # noqa: ANN001, ANN202
        r = torch.rsqrt(s.square().mean(-1, keepdim=True) + eps)
        g = dh * weight
        return r * g - s * (r.pow(3) * (g * s).mean(-1, keepdim=True))

    def unrotate(dy, cos, sin):  # noqa: ANN001, ANN202
        z = dy * sin
        half = z.shape[-1] // 2
        return dy * cos + torch.cat((z[..., half:], -z[..., :half]), dim=-1)

    class AddRmsNorm(Function):
        @staticmethod
        def forward(ctx, x, residual, weight, eps):  # noqa: ANN001, ANN205
            h, s = ext.add_rms_norm(x, residual, weight, eps)
            ctx.save_for_backward(s, weight)
            ctx.eps = eps
            ctx.set_materialize_grads(False)
            return h, s

        @staticmethod
        def backward(ctx, dh, ds):  # noqa: ANN001, ANN205
            s, weight = ctx.saved_tensors
            grad = None if dh is None else rms_backward(dh, s, weight, ctx.eps)
            if ds is not None:
                grad = ds if grad is None else grad + ds
            return grad, grad, None, None

    class SiluAndMul(Function):
        @staticmethod
        def forward(ctx, gate_up):  # noqa: ANN001, ANN205
            ctx.save_for_backward(gate_up)
            return ext.silu_and_mul(gate_up)

        @staticmethod
        def backward(ctx, dy):  # noqa: ANN001, ANN205
            (gate_up,) = ctx.saved_tensors
            gate, up = gate_up.chunk(2, dim=-1)
            sig = torch.sigmoid(gate)
            silu = gate * sig
            return torch.cat([dy * up * (sig + silu * (1 - sig)), dy * silu], dim=-1)

    class QkvRope(Function):
        @staticmethod
        def forward(ctx, qkv, cos, sin, hq, hkv, d):  # noqa: ANN001, ANN205
            ctx.save_for_backward(cos, sin)
            ctx.set_materialize_grads(False)
            ctx.shape = (qkv.shape[0], hq, hkv, d)
            return ext.qkv_rope(qkv, cos, sin, hq, hkv, d)

        @staticmethod
        def backward(ctx, dq, dk, dv):  # noqa: ANN001, ANN205
            cos, sin = ctx.saved_tensors
            t, hq, hkv, d = ctx.shape
            parts = []
            for grad, heads, rotated in ((dq, hq, True), (dk, hkv, True), (dv, hkv, False)):
                if grad is None:
                    parts.append(cos.new_zeros(t, heads * d))
                else:
                    parts.append((unrotate(grad, cos, sin) if rotated else grad).reshape(t, heads * d))
            return torch.cat(parts, dim=-1), None, None, None, None, None

    today = learner_ops(ext)

    def add_rms_norm(x, residual, weight, eps):  # noqa: ANN001, ANN202
        if residual is None:
            return today.add_rms_norm(x, None, weight, eps)  # (its _RmsNorm: the final norm, once a step)
        return AddRmsNorm.apply(x.contiguous(), residual.contiguous(), weight, eps)

    return LayerOps(add_rms_norm=add_rms_norm, rms_norm=today.rms_norm,
                    silu_and_mul=lambda g: SiluAndMul.apply(g.contiguous()), rope=_torch_rope,
                    qkv_rope=lambda qkv, cos, sin, hq, hkv, d: QkvRope.apply(qkv.contiguous(), cos, sin, hq, hkv, d),
                    name="learner(cpu, session 17)")


def _kernel_at(rev: str | None):  # noqa: ANN202
    """cpu_matmul.matmul with the quantized matmul's source as it was at git revision `rev` (None: as
    it is in the tree), built alone."""
    from quant_matmul_rows import source_at, standalone

    from ruvllm.quant import cpu_matmul

    fn = standalone(source_at(rev))

    def matmul(x: torch.Tensor, w: cpu_matmul.Packed) -> torch.Tensor:
        xf = x if x.dtype == torch.float32 and x.is_contiguous() else x.float().contiguous()
        y = fn(xf, w.codes, w.scales, w.zeros, w.group, w.int4)
        return y if y.dtype == x.dtype else y.to(x.dtype)
    return matmul


@contextlib.contextmanager
def _ops(layers: LearnedLayers, ops):  # noqa: ANN001, ANN202
    """The learned layers' element-wise ops swapped for `ops` (None: as they are) within the block,
    and then their attention causal_attention's torch ops and their micro-LoRA pieces session 17's
    torch ops (as before session 18)."""
    kept = layers.ops, layers._ext
    if ops is not None:
        layers.ops, layers._ext = ops, None
        layers._linear_for = lambda lora: _session17_linear(layers, lora)
    try:
        yield
    finally:
        layers.ops, layers._ext = kept
        layers.__dict__.pop("_linear_for", None)


@contextlib.contextmanager
def _matmul(fn):  # noqa: ANN001, ANN202
    """cpu_matmul.matmul swapped for `fn` (None: as it is) within the block."""
    from ruvllm.quant import cpu_matmul

    if fn is None:
        yield
        return
    kept, cpu_matmul.matmul = cpu_matmul.matmul, fn
    try:
        yield
    finally:
        cpu_matmul.matmul = kept


@contextlib.contextmanager
def _adam(one_call: bool):  # noqa: ANN202
    """Adam as the step takes it now (instant.adam_step: the fused kernel's one call), or, for the
    arms of the learner before session 20, through Optimizer.step()."""
    from ruvllm.learning import instant

    kept = instant.adam_step
    if not one_call:
        instant.adam_step = lambda opt, ext=None: opt.step()
    try:
        yield
    finally:
        instant.adam_step = kept


def _session18_logits(instant: InstantLearner, rows, labels, negatives=None, exact=None):  # noqa: ANN001, ANN202
    """InstantLearner._logits as session 18 left it (for the before arms): every drawn candidate its
    own column, the exact ones' head rows gathered in each step, torch's products."""
    import math

    head, n = instant.layers.head, instant.config.candidates
    drawn = instant.candidates.take(n)
    exact = exact or instant._exact(labels, negatives)
    clash = exact.hit.index_select(0, drawn.tokens)
    kept = n - int(clash.sum())
    bias = torch.full((n,), math.log((head.shape[0] - len(exact.ids)) / max(kept, 1)))
    bias.masked_fill_(clash, float("-inf"))
    return torch.cat([rows @ head.index_select(0, exact.ids).t(), rows @ drawn.rows.t() + bias], dim=1), exact.index


_JUNK: list[torch.Tensor] = []


def _evict() -> None:
    """Write 64 MB, as serving's traffic between the background pass and an update does: what was
    gathered ahead is read back from memory, not from the caches."""
    if not _JUNK:
        _JUNK.append(torch.zeros(16 << 20))
    _JUNK[0].add_(1.0)


def _whole(src, prompt: list[int], target: list[int], args: argparse.Namespace) -> None:  # noqa: ANN001
    """--whole: the update's own step (frozen context, packed weights, no KL term) with the learned
    layers as one C++ call each way (learning/whole_layers.py, the default) against the autograd
    path (session 18's learner, LearnedLayers(whole=False)), arms alternating step by step, each its
    own tenant of the same seed; wall time, and the thread's CPU time (the step's own work under load)."""
    model = load_learning_model(src)[0]
    n = InstantConfig().layers
    whole_only = "+ the learned layers one C++ call each way"
    session19 = "+ the drawn candidates pooled (session 19)"
    session20 = "+ no autograd graph (the loss one C++ call), Adam one call (session 20, the default)"
    arms = {} if args.since_19 else {"session 18: the learned layers as autograd's graph, every drawn column":
                                     LearnedLayers(model, n, whole=False), whole_only: LearnedLayers(model, n)}
    arms |= {session19: LearnedLayers(model, n), session20: LearnedLayers(model, n)}
    runs = {}
    for name, layers in arms.items():
        learner = InstantLearner(layers, InstantConfig())
        if not layers._whole or name == whole_only:  # session 18's sampled softmax: every drawn column
            learner._logits = functools.partial(_session18_logits, learner)
        learner.graphless = name == session20
        runs[name] = learner, learner.prepare(prompt, target), learner.new_tenant(0)
    def ahead(learner: InstantLearner) -> None:  # the drawn candidates gathered ahead, as the background pass does
        learner.fill_candidates()
        _evict()

    def around(name: str):  # noqa: ANN202 (the arms before session 20 step Adam through Optimizer.step)
        return _adam(name == session20)

    times, cpu, loads = _time_arms(runs, args.steps, time.thread_time, around=around,
                                   before=ahead if args.candidates_ahead else None)
    _step_table(times, cpu, loads, args, len(prompt), len(target), "this thread")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--contexts", default="full,frozen")
    ap.add_argument("--memory", action="store_true")
    ap.add_argument("--memory-child", choices=("float32", "packed"), help=argparse.SUPPRESS)
    ap.add_argument("--profile", metavar="FORM/CONTEXT", help="torch.profiler's table of one arm's steps")
    ap.add_argument("--batch", type=int, default=0, help="N events: one step each against one batched step")
    ap.add_argument("--update", action="store_true", help="the whole update through the Learner (KL term on)")
    ap.add_argument("--candidates-ahead", action="store_true",
                    help="--update: the default with the drawn candidates made ahead against drawn in the step")
    ap.add_argument("--phases", action="store_true", help="per-phase timers of a step with the KL term in it")
    ap.add_argument("--whole", action="store_true",
                    help="the frozen step (with --update: the whole update) with the learned layers as one C++ call "
                         "each way against autograd's graph of them, alternating")
    ap.add_argument("--since-19", action="store_true",
                    help="--whole: only session 19's step and the default (session 20's), alternating")
    ap.add_argument("--since-20", action="store_true",
                    help="--whole: only session 20's update and the default (session 21's), alternating")
    ap.add_argument("--coalesce", type=int, default=1,
                    help="--update: N feedback events a turn learned as one backlog (one step, the KL term in it)")
    ap.add_argument("--cut", action="store_true", help="session 17's cuts to the step, arm by arm")
    ap.add_argument("--kernel-rev", default="7a2d421",
                    help="--cut and --update: an arm with the quantized matmul's source at this git revision "
                         "(default: before session 18's 8-bit path)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.update:
        return _update(args)
    if args.memory_child:
        return _memory_child(args.memory_child)
    if args.memory:
        for form in ("float32", "packed"):
            subprocess.run([sys.executable, __file__, "--memory-child", form, "--threads", str(args.threads)],
                           check=True)
        return
    src = resolve_model(None)
    prompt, target = _pair(src)
    if args.batch:
        return _batched(src, prompt, target, args)
    if args.phases:
        return _phases(src, prompt, target, args)
    if args.cut:
        return _cut(src, prompt, target, args)
    if args.whole:
        return _whole(src, prompt, target, args)
    models = {"float32": load_learning_model(src, packed=False)[0], "packed": load_learning_model(src)[0]}
    arms: dict[str, InstantLearner] = {}
    for context in args.contexts.split(","):
        for form, model in models.items():
            arms[f"{form}/{context}"] = InstantLearner(LearnedLayers(model, InstantConfig().layers),
                                                       InstantConfig(context=context))
    preps, prepare_ms, states = {}, {}, {}
    for name, learner in arms.items():
        learner.prepare(prompt, target)  # warm
        t = time.perf_counter()
        preps[name] = learner.prepare(prompt, target)
        prepare_ms[name] = (time.perf_counter() - t) * 1000
        states[name] = learner.new_tenant(0)
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        learner = arms[args.profile]
        for _ in range(3):
            learner.step(states[args.profile], preps[args.profile], 1.0)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(args.steps):
                learner.step(states[args.profile], preps[args.profile], 1.0)
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
        return
    times: dict[str, list[float]] = {name: [] for name in arms}
    fb: dict[str, list[float]] = {name: [] for name in arms}
    for _ in range(args.steps):
        for name, learner in arms.items():  # arms alternate, step by step
            t = time.perf_counter()
            timing = learner.step(states[name], preps[name], 1.0)
            times[name].append((time.perf_counter() - t) * 1000)
            fb[name].append(timing.forward_backward * 1000)
    print(f"load average {os.getloadavg()[0]:.2f} {os.getloadavg()[1]:.2f}, {args.threads} threads, "
          f"{args.steps} steps an arm (first 2 dropped), prompt {len(prompt)} + target {len(target)} tokens")
    print("| weights / context | step p50 | step p90 | forward+backward p50 | Adam etc. | preparation |")
    print("|---|---|---|---|---|---|")
    for name in arms:
        t, f = times[name][2:], fb[name][2:]
        print(f"| {name} | {statistics.median(t):.1f} ms | {statistics.quantiles(t, n=10)[-1]:.1f} ms | "
              f"{statistics.median(f):.1f} ms | {statistics.median(t) - statistics.median(f):.1f} ms | "
              f"{prepare_ms[name]:.0f} ms |")


if __name__ == "__main__":
    main()
