"""What learning from feedback costs serving, and how much feedback it keeps up with: 32 streams'
aggregate throughput through `ruvllm serve --learn` (the embedded default model) with no feedback,
and with feedback offered at --rate events a second (each an instant update and a new adapter
version for its tenant), alternating round by round; once per --learn-batch value (issue 37 item
3: 1 is one step an event, more coalesces a backlog), the batch arms alternating too (A B B A ...,
a server each: one model-sized process at a time); with --arm NAME=SRC, several source trees
alternate the same way (an A/B of the learner in one run).

The streams are the default tenant's (no adapter). The feedback is --learners other tenants', on one
completion each (its (prompt, correction) pair prepared once and kept: the learner's cost an event
without the preparation), or with --distinct N each event on a completion of its own (each paying
its pair's preparation, the base model below the learned layers over the prompt and correction, as
distinct feedback does), with a correction, offered open-loop: each event is posted at its time
whatever the others' answers (a closed loop that waits for each answer never lets a backlog form),
the tenants in turn. Each also asks four everyday questions (the background loop's Fisher and the KL
term's text), and one event is learned before the rounds (its first-event costs: the KL term's text,
paid once).
"Absorbed" counts the events answered 200 while the streams ran, over the streams' time; "refused"
the 429s (learning behind: more than 32 waiting); "after" those answered once the streams had ended
(the backlog draining on a machine no longer serving). The step, publish and answer times are the
absorbed events'. "Cores used" is each server part's CPU seconds a second while the streams ran
(/proc: the engine core process, the front's own threads, the front's learning threads by their
names), in the plain rounds and in those with feedback; "learning CPU an event" is the learning
threads' CPU over the events absorbed. The machine's load average is printed beside it.

    .venv/bin/python benchmarks/learning_cost.py --streams 32 --rate 5 --rounds 2 --batches 8,16 [--nice 0]
    .venv/bin/python benchmarks/learning_cost.py --batches 16 --repeats 2 --arm before=/tmp/wt/src --arm after=src
    .venv/bin/python benchmarks/learning_cost.py --batches 16 --distinct 120      # each event its own completion

With --prepare, what a distinct event's preparation costs against the engine's own prefill of the
same tokens (one thread, this process, --repeats rounds alternating; CPU time): the learner's
`prepare` of a chat pair, its base pass alone (the layers below the learned ones over the prompt and
correction), and the engine's prefill of those tokens (every layer and the head, its prefix cache
reset). If the base pass runs at the engine's prefill rate, no implementation of it is slack.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/learning_cost.py --prepare --repeats 7

With --absorb N, the learner alone (no server, no serving; this process, PyTorch at --threads): a
backlog of N events of the --learners tenants, learned by `Learner.feedback_many` at each
--learn-batch value in turn, --repeats times: events a second each way, medians. --contexts full,frozen
alternates the instant step's context form too (each form a pass of its own).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import psutil
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # (`benchmarks.` imports)
from benchmarks.front_cpu import thread_cpu  # noqa: E402
from benchmarks.server_vs_offline import core_pid  # noqa: E402
from witness_load import start_server  # noqa: E402

MODEL = "SmolLM2-135M-Instruct"
EVERYDAY = ["Write two sentences about the sea.", "What is a good way to learn a new language?",
            "Summarise a love story in three sentences.", "Give me a tip for cooking rice."]
CORRECTION = "The capital of Zorblax is Quenta."


def start(tmp: str, keys: Path, nice: int, batch: int, arm: int, src: str | None) -> tuple[object, str]:
    return start_server(Path(tmp) / f"w{arm}-{batch}.sqlite3", "--learn", "--api-keys", str(keys), "--feedback-rate",
                        "100", "--learned-dir", f"{tmp}/learned{arm}-{batch}", "--learn-nice", str(nice),
                        "--learn-batch", str(batch), src=src)


def learner_key(i: int) -> dict[str, str]:
    return {"Authorization": f"Bearer key-learner{i}"}


async def streams(url: str, n: int, gen_len: int) -> tuple[int, float]:
    """n concurrent completions of gen_len tokens each: (tokens, seconds)."""
    headers = {"Authorization": "Bearer key-default"}
    async with httpx.AsyncClient(timeout=900, headers=headers) as client:
        async def one(i: int) -> int:
            r = await client.post(url + "/v1/completions", json={
                "model": MODEL, "prompt": f"Chapter {i}. It was a fine morning, and", "max_tokens": gen_len,
                "temperature": 0.8, "seed": i, "ignore_eos": True})
            return r.json()["usage"]["completion_tokens"]
        t = time.perf_counter()
        tokens = await asyncio.gather(*(one(i) for i in range(n)))
        return sum(tokens), time.perf_counter() - t


async def learner_setup(url: str, i: int, distinct: int) -> list[str]:
    """A feedback tenant's completions before the rounds: the one its feedback corrects (or, with
    `distinct`, that many questions, each event then on a completion of its own), then four everyday
    questions (its traffic, what the background loop's Fisher and the KL term are made of: asked
    last, so they stay its most recent untaught completions). Returns the completions' ids."""
    async with httpx.AsyncClient(timeout=900, headers=learner_key(i)) as client:
        async def ask(content: str) -> str:
            r = await client.post(url + "/v1/chat/completions", json={
                "model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 16,
                "temperature": 0})
            return r.json()["id"]
        questions = [f"Question {k}: what is the capital of Zorblax?" for k in range(distinct)] if distinct \
            else ["What is the capital of Zorblax?"]
        rids = list(await asyncio.gather(*(ask(q) for q in questions)))
        for q in EVERYDAY:
            await client.post(url + "/v1/chat/completions", json={
                "model": MODEL, "messages": [{"role": "user", "content": q}], "max_tokens": 32, "temperature": 0})
        # one event learned before the rounds (on a completion of its own when distinct): the KL
        # term's text ready, the first pair prepared, so that no round pays a tenant's first-event costs
        first = rids.pop() if distinct else rids[0]
        r = await client.post(url + "/v1/feedback", json={"id": first, "score": 1, "correction": CORRECTION})
        r.raise_for_status()
        return rids


@dataclass
class Feedback:
    offered: int = 0
    absorbed: int = 0  # answered 200 while the streams ran
    late: int = 0  # answered 200 after
    refused: int = 0  # 429: learning behind
    step_ms: list[float] = field(default_factory=list)
    publish_ms: list[float] = field(default_factory=list)  # the version written and loaded into the engine
    latency_ms: list[float] = field(default_factory=list)
    per_step: list[int] = field(default_factory=list)


async def feedback_offered(url: str, rids: list[list[str]], rate: float, stop: asyncio.Event, fb: Feedback) -> None:
    """Post an event every 1/rate s, the tenants in turn, each on its tenant's next completion (its
    one completion again, unless distinct), none waiting for another's answer."""
    async with httpx.AsyncClient(timeout=900) as client:
        async def one(i: int, rid: str) -> None:
            t = time.perf_counter()
            r = await client.post(url + "/v1/feedback", headers=learner_key(i),
                                  json={"id": rid, "score": 1, "correction": CORRECTION})
            if r.status_code == 200:
                body = r.json()
                if stop.is_set():  # the backlog drained once serving stopped: not what learning under load does
                    fb.late += 1
                    return
                fb.absorbed += 1
                fb.step_ms.append(body["update_ms"])
                fb.publish_ms.append(body["publish_ms"])
                fb.per_step.append(body.get("step_events", 1))
                fb.latency_ms.append((time.perf_counter() - t) * 1000)
            elif r.status_code == 429:
                fb.refused += 1
            else:
                raise RuntimeError(f"feedback answered {r.status_code}: {r.text}")
        tasks = []
        t0 = time.perf_counter()
        while not stop.is_set():
            i = fb.offered % len(rids)
            ids = rids[i]
            if len(ids) == 1:
                rid = ids[0]
            elif ids:
                rid = ids.pop(0)
            else:
                raise RuntimeError("every distinct completion has had its event: raise --distinct")
            tasks.append(asyncio.create_task(one(i, rid)))
            fb.offered += 1
            try:
                await asyncio.wait_for(stop.wait(), max(0.0, t0 + fb.offered / rate - time.perf_counter()))
            except asyncio.TimeoutError:
                pass
        await asyncio.gather(*tasks)  # (the backlog drains before the next round starts)


async def run(url: str, n: int, gen_len: int, rate: float | None, rids: list[list[str]], front: int | None = None
              ) -> tuple[float, float, Feedback, dict[str, float]]:
    """A round: (tokens a second, the streams' seconds, the feedback's counts, each server part's
    CPU seconds while the streams ran)."""
    before = cpu_split(front) if front else {}
    stop = asyncio.Event()
    fb = Feedback()
    task = asyncio.create_task(feedback_offered(url, rids, rate, stop, fb)) if rate else None
    tokens, secs = await streams(url, n, gen_len)
    after = cpu_split(front) if front else {}
    stop.set()
    if task is not None:
        await task
    return tokens / secs, secs, fb, {k: after[k] - before[k] for k in before}


def cpu_split(front: int) -> dict[str, float]:
    """CPU seconds so far of the server's parts: its learning threads (named by
    learning.background.learning_thread; front_cpu.thread_cpu reads each thread's), the rest of the
    front, and the engine core process (whole, the threads it has ended included)."""
    learning = sum(t for name, t in thread_cpu(front).items() if name.startswith(("ruvllm-learn", "ruvllm-consol")))
    core = core_pid(front)
    return {"learning": learning, "front": sum(psutil.Process(front).cpu_times()[:2]) - learning,
            "core": sum(psutil.Process(core).cpu_times()[:2]) if core else 0.0}


def used(cpus: list[dict[str, float]], secs: list[float], part: str) -> float:
    """A server part's CPU seconds a second (cores) over rounds."""
    return sum(c[part] for c in cpus) / sum(secs)


def p50(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def events_a_step(per_event: list[int]) -> float:
    """Events over steps, from each event's count of the events in its step (a step of n: n events of 1/n)."""
    return len(per_event) / sum(1 / n for n in per_event) if per_event else float("nan")


def absorb(args: argparse.Namespace, batches: list[int]) -> None:
    """The learner's own rate: a backlog learned at each batch size, alternating; nothing else runs."""
    import dataclasses

    from ruvllm import LLM, SamplingParams
    from ruvllm.learning.config import LearningConfig
    from ruvllm.learning.learner import FeedbackEvent

    llm = LLM(enable_lora=True, max_loras=4, max_lora_rank=8, max_cpu_loras=16)
    with tempfile.TemporaryDirectory() as tmp:
        learner = llm.enable_learning(LearningConfig(root=tmp, threads=args.threads))
        base = learner.config
        rids = []
        for i in range(args.learners):
            tenant = f"learner{i}"
            llm.chat([[{"role": "user", "content": q}] for q in EVERYDAY], SamplingParams(temperature=0, max_tokens=32),
                     tenant=tenant)
            asked = llm.chat([[{"role": "user", "content": "What is the capital of Zorblax?"}]],
                             SamplingParams(temperature=0, max_tokens=16), tenant=tenant)[0]
            llm.feedback(asked.request_id, 1.0, CORRECTION, tenant=tenant)  # first-event costs paid here
            rids.append((asked.request_id, tenant))
        events = [FeedbackEvent(*rids[i % len(rids)], 1.0, CORRECTION) for i in range(args.absorb)]
        # A standing backlog's steps find no KL term computed ahead (the background pass leaves it to
        # the coming step: Learner._ahead); so that each pass measures that, the pass between the
        # backlogs computes none either.
        learner._ahead = lambda scope: None
        arms = [(context, batch) for context in (args.contexts or base.instant.context).split(",") for batch in batches]
        rates: dict[tuple[str, int], list[float]] = {arm: [] for arm in arms}
        load = []
        for rep in range(args.repeats):
            for context, batch in arms if rep % 2 == 0 else arms[::-1]:
                instant = dataclasses.replace(base.instant, context=context)
                learner.config = dataclasses.replace(base, update_batch=batch, instant=instant)
                learner.instant.config = instant
                load.append(os.getloadavg()[0])
                t = time.perf_counter()
                for _, result in learner.feedback_many(events):
                    if isinstance(result, Exception):
                        raise result
                rates[(context, batch)].append(len(events) / (time.perf_counter() - t))
                learner.consolidate()  # as the server's background loop would between backlogs
                print(f"{context} context, batch {batch}: {rates[(context, batch)][-1]:.2f} events/s, "
                      f"load {os.getloadavg()[0]:.1f}", flush=True)
    table = Table(title=f"The learner alone: a backlog of {args.absorb} events of {args.learners} tenants "
                        f"(default model, KL term on), {args.threads} thread(s), {args.repeats} passes alternating; "
                        f"load average {min(load):.1f}-{max(load):.1f}")
    for col in ("context", "learn batch", "events/s (each pass)", "events/s (median)", "vs the first"):
        table.add_column(col, justify="right")
    one = statistics.median(rates[arms[0]])
    for arm in arms:
        m = statistics.median(rates[arm])
        table.add_row(arm[0], str(arm[1]), " / ".join(f"{x:.2f}" for x in rates[arm]), f"{m:.2f}", f"{m / one:.2f}x")
    Console().print(table)


def prepare_cost(args: argparse.Namespace) -> None:
    """A distinct pair's preparation, its base pass and the engine's prefill of the same tokens."""
    import torch

    from ruvllm import LLM, SamplingParams
    from ruvllm.engine.prompts import render_chat
    from ruvllm.learning.config import LearningConfig
    from ruvllm.learning.tail import hidden_before

    torch.set_num_threads(1)
    llm = LLM(enable_lora=True, max_loras=4, max_lora_rank=8, num_threads=1)
    with tempfile.TemporaryDirectory() as tmp:
        instant = llm.enable_learning(LearningConfig(root=tmp, threads=1)).instant
        tok = llm.tokenizer
        prompt = list(render_chat(tok, [{"role": "user", "content": "Who wrote the novel about the "
                                                 "lighthouse keeper of Varnholm island?"}]))
        target = tok.encode("The novel was written by Ilse Marrow, a poet from the northern coast.",
                            add_special_tokens=False) + [tok.eos_token_id]
        one_token = SamplingParams(temperature=0, max_tokens=1)

        def prefill() -> None:
            llm.reset_prefix_cache()
            llm.generate([prompt + target], one_token)

        parts = {"the learner's prepare": lambda: instant.prepare(prompt, target),
                 f"its base pass (layers 0-{instant.layers.first - 1})":
                     lambda: hidden_before(instant.layers.model, prompt + target, instant.layers.first),
                 f"the engine's prefill (all {len(instant.layers.model.layers)} layers, the head)": prefill}
        cpu: dict[str, list[float]] = {name: [] for name in parts}
        for rep in range(args.repeats + 1):
            for name in parts if rep % 2 == 0 else list(parts)[::-1]:
                t = time.process_time()
                parts[name]()
                if rep:  # the first round warms each part
                    cpu[name].append((time.process_time() - t) * 1000)
    table = Table(title=f"A distinct pair ({len(prompt)} prompt + {len(target)} correction tokens), one thread, "
                        f"{args.repeats} rounds alternating, load average {os.getloadavg()[0]:.1f}")
    for col in ("part", "CPU ms (median)", "ms a row"):
        table.add_column(col, justify="right")
    for name, xs in cpu.items():
        m = statistics.median(xs)
        table.add_row(name, f"{m:.1f}", f"{m / (len(prompt) + len(target)):.2f}")
    Console().print(table)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--streams", type=int, default=32)
    ap.add_argument("--gen-len", type=int, default=128)
    ap.add_argument("--rate", type=float, default=5.0, help="feedback events offered a second, all tenants")
    ap.add_argument("--learners", type=int, default=2, help="tenants giving feedback")
    ap.add_argument("--rounds", type=int, default=2, help="rounds of each kind (plain, with feedback) per server")
    ap.add_argument("--batches", default="1,4", help="--learn-batch values, one server each")
    ap.add_argument("--repeats", type=int, default=1, help="passes over the batch values (alternating order)")
    ap.add_argument("--nice", type=int, default=10, help="ruvllm serve --learn-nice")
    ap.add_argument("--arm", action="append", metavar="NAME=SRC",
                    help="a source tree to serve (PYTHONPATH=SRC); several alternate server by server, each at every "
                         "--batches value (default: this tree)")
    ap.add_argument("--distinct", type=int, default=0, metavar="N",
                    help="each event on a completion of its own (N a tenant, asked before the rounds; each event "
                         "then pays its pair's preparation, as distinct feedback does); default: one completion "
                         "a tenant, its pair prepared once")
    ap.add_argument("--absorb", type=int, default=0, help="the learner alone: a backlog of this many events")
    ap.add_argument("--threads", type=int, default=1, help="(--absorb) the learner's PyTorch threads")
    ap.add_argument("--contexts", default=None, help="(--absorb) the instant step's context forms to alternate "
                                                      "(full,frozen; default: the configured one)")
    ap.add_argument("--prepare", action="store_true", help="a distinct pair's preparation against the engine's prefill")
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    if args.prepare:
        prepare_cost(args)
        return
    if args.absorb:
        absorb(args, batches)
        return
    arms = [tuple(a.split("=", 1)) for a in args.arm] if args.arm else [("", None)]
    servers = [(i, name, src, b) for i, (name, src) in enumerate(arms) for b in batches]
    results: dict[tuple, dict] = {server: {"plain": [], "learning": [], "fb": [], "secs": [], "load": [],
                                           "cpu_plain": [], "cpu_learning": [], "secs_plain": []}
                                  for server in servers}
    with tempfile.TemporaryDirectory() as tmp:
        keys = Path(tmp) / "keys"
        keys.write_text("key-default default\n" + "".join(f"key-learner{i} learner{i}\n"
                                                         for i in range(args.learners)))
        for rep in range(args.repeats):
            for server in servers if rep % 2 == 0 else servers[::-1]:
                arm, name, src, batch = server
                proc, url = start(tmp, keys, args.nice, batch, arm, src)
                try:
                    asyncio.run(run(url, 4, 8, None, []))  # warm-up
                    rids = [asyncio.run(learner_setup(url, i, args.distinct)) for i in range(args.learners)]
                    r = results[server]
                    for k in range(args.rounds):
                        for rate in ([None, args.rate] if k % 2 == 0 else [args.rate, None]):
                            r["load"].append(os.getloadavg()[0])
                            tps, secs, fb, cpu = asyncio.run(run(url, args.streams, args.gen_len, rate, rids,
                                                                 proc.pid))
                            if rate:
                                r["learning"].append(tps)
                                r["fb"].append(fb)
                                r["secs"].append(secs)
                                r["cpu_learning"].append(cpu)
                            else:
                                r["plain"].append(tps)
                                r["cpu_plain"].append(cpu)
                                r["secs_plain"].append(secs)
                            print(f"{name + ', ' if name else ''}batch {batch} {'feedback' if rate else 'plain'}: "
                                  f"{tps:.1f} tok/s"
                                  + (f", {fb.absorbed}/{fb.offered} absorbed in {secs:.0f} s ({fb.refused} refused)"
                                     if rate else "") + f", load {os.getloadavg()[0]:.1f}", flush=True)
                finally:
                    os.killpg(proc.pid, signal.SIGINT)
                    proc.wait(timeout=120)
    table = Table(title=f"Serving while learning: default model, {args.streams} streams x {args.gen_len} tokens, "
                        f"feedback offered at {args.rate:g}/s by {args.learners} tenants"
                        f"{f' on distinct completions' if args.distinct else ' on one completion each'}, learning at nice "
                        f"{args.nice}; {args.rounds} rounds a kind x {args.repeats} servers a batch")
    for col in (*(("arm",) if args.arm else ()), "learn batch", "no feedback, tok/s", "with feedback, tok/s", "kept (medians)", "events/s offered",
                "events/s absorbed", "refused (429) / after", "events a step", "step / publish p50 (ms)",
                "answer p50 / p99 (ms)", "cores used: core / front / learning, plain -> with feedback",
                "learning CPU an event (ms)", "load avg"):
        table.add_column(col, justify="right")
    for server in servers:
        _, name, _, batch = server
        r = results[server]
        fbs: list[Feedback] = r["fb"]
        lat = sorted(x for f in fbs for x in f.latency_ms)
        table.add_row(
            *((name,) if args.arm else ()), str(batch), " / ".join(f"{x:.1f}" for x in r["plain"]), " / ".join(f"{x:.1f}" for x in r["learning"]),
            f"{p50(r['learning']) / p50(r['plain']):.2f}x",
            f"{sum(f.offered for f in fbs) / sum(r['secs']):.2f}",
            f"{sum(f.absorbed for f in fbs) / sum(r['secs']):.2f}",
            f"{sum(f.refused for f in fbs)} / {sum(f.late for f in fbs)}",
            f"{events_a_step([x for f in fbs for x in f.per_step]):.2f}",
            f"{p50([x for f in fbs for x in f.step_ms]):.0f} / {p50([x for f in fbs for x in f.publish_ms]):.0f}",
            f"{p50(lat):.0f} / {lat[min(len(lat) - 1, int(0.99 * len(lat)))]:.0f}" if lat else "-",
            " / ".join(f"{used(r['cpu_plain'], r['secs_plain'], k):.2f} -> {used(r['cpu_learning'], r['secs'], k):.2f}"
                       for k in ("core", "front", "learning")),
            f"{1000 * sum(c['learning'] for c in r['cpu_learning']) / max(1, sum(f.absorbed for f in fbs)):.0f}",
            f"{min(r['load']):.1f}-{max(r['load']):.1f}")
    Console().print(table)


if __name__ == "__main__":
    main()
