"""A backlog of feedback coalesced (issue 37 item 3), through the real server on the tiny model: the
events that wait while the update thread is busy are learned each tenant's in fewer steps than
events, every event answered with its own loss and version and witnessed, the background loop's
pull counted by events as before (its Fisher by updates), another tenant's outputs bitwise the same; and the server's steps are
bitwise what `InstantLearner.step` (a lone event) and `step_events` (several) give run by hand on the
same events."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import openai
import pytest
import torch

from ruvllm import LLM
from ruvllm.learning.anchor import kl_mean, make_anchor
from ruvllm.learning.config import InstantConfig, LearningConfig
from ruvllm.learning.instant import InstantLearner
from ruvllm.learning.learner import Learner, _seed
from ruvllm.learning.tail import MicroLora
from ruvllm.server.tenants import read_api_keys
from ruvllm.witness.log import find, verify
from tests.server.conftest import MODEL, RunningServer, start_server

KEYS = {"acme": "key-a", "globex": "key-b", "initech": "key-c"}
ASKED = {"acme": [[5, 80, 23, 311, 42, 17], [6, 61, 201, 13, 8, 250, 4]], "globex": [[12, 99, 4, 77, 131]]}
EVERYDAY = [[40, 41, 42, 43], [50, 51, 52]]  # each feedback tenant's two most recent: the KL term's text
# (tenant, which of its asked completions, score, correction), in the order they are posted
EVENTS = [("acme", 0, 1.0, "t7 t7 t7"), ("globex", 0, 1.0, "t9 t9"), ("acme", 1, -0.5, None),
          ("acme", 0, 0.7, "t8 t7"), ("globex", 0, -1.0, None), ("acme", 1, 1.0, "t7 t8 t9 t7"),
          ("globex", 0, 0.5, "t9 t9 t9"), ("acme", 0, 1.0, "t7 t7 t7")]


@pytest.fixture(scope="module")
def lora_llm(tiny_model_dir: Path) -> LLM:
    return LLM(str(tiny_model_dir), enable_lora=True, max_loras=4, max_lora_rank=4, quantization="none")


def _complete(server: RunningServer, tenant: str, prompt: list[int]) -> tuple[str, list, list]:
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=KEYS[tenant], max_retries=0)
    out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0, logprobs=1,
                                    extra_body={"ignore_eos": True})
    return out.id, out.choices[0].logprobs.tokens, out.choices[0].logprobs.token_logprobs


def _until(check: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + 30
    while not check():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


def test_a_backlog_is_learned_in_fewer_steps_each_event_answered(lora_llm: LLM, tmp_path: Path) -> None:
    (tmp_path / "keys").write_text("".join(f"{key} {tenant}\n" for tenant, key in KEYS.items()))
    instant = InstantConfig(layers=1, lr=5e-2, candidates=0, kl_weight=2.0, kl_samples=2)
    learning = LearningConfig(instant=instant, root=str(tmp_path / "learned"), update_batch=3)
    for running in start_server(lora_llm, api_keys=read_api_keys(tmp_path / "keys"), learning=learning,
                                feedback_rate=100, feedback_burst=50, witness_log=str(tmp_path / "w.sqlite3")):
        asked = {t: [_complete(running, t, p)[0] for p in prompts] for t, prompts in ASKED.items()}
        for tenant in ASKED:
            for prompt in EVERYDAY:
                _complete(running, tenant, prompt)
        other_before = _complete(running, "initech", ASKED["acme"][0])[1:]
        learner: Learner = running.app.state.ruvllm.service.learner
        waiting = running.app.state.ruvllm.feedback

        # The learner busy (its lock held here) while all eight are posted, one after another: the
        # first is taken at once (its step waits for the lock), the other seven wait as a backlog.
        answers: list[httpx.Response | None] = [None] * len(EVENTS)

        def post(i: int, tenant: str, which: int, score: float, correction: str | None) -> None:
            body = {"id": asked[tenant][which], "score": score, **({"correction": correction} if correction else {})}
            answers[i] = httpx.post(running.url + "/v1/feedback", json=body, timeout=120,
                                    headers={"Authorization": f"Bearer {KEYS[tenant]}"})

        threads = []
        with learner._lock:
            for i, event in enumerate(EVENTS):
                threads.append(threading.Thread(target=post, args=(i, *event)))
                threads[-1].start()
                _until(lambda: waiting.waiting == i + 1, "a feedback event never reached the update thread")
                if i == 0:  # the first taken alone: its step waits for the lock, the rest queue behind it
                    _until(lambda: waiting.updates.queued == 0, "the update thread never took the first event")
        for thread in threads:
            thread.join(timeout=120)
        bodies = []
        for answer in answers:
            assert answer is not None and answer.status_code == 200, answer and answer.text
            bodies.append(answer.json())

        # Each event's step: the events that share a version were learned in one step
        steps: dict[str, dict[str, list[int]]] = {}
        for i, ((tenant, *_), body) in enumerate(zip(EVENTS, bodies)):
            steps.setdefault(tenant, {}).setdefault(body["adapter"], []).append(i)
        for tenant, by_version in steps.items():
            for version, events in by_version.items():
                assert all(bodies[i]["step_events"] == len(events) for i in events)
                assert events == sorted(events)  # a tenant's events in the order they came
            assert sorted(by_version, key=lambda v: int(v.rsplit("v", 1)[1])) == list(by_version)  # in order
            n = sum(t == tenant for t, *_ in EVENTS)
            assert len(by_version) < n and max(len(e) for e in by_version.values()) <= 3  # coalesced, bounded
            assert learner._tenants[tenant].steps == len(by_version) == len(learner.policy.versions(tenant))
        assert [len(e) for e in steps["acme"].values()] == [1, 3, 1]  # the first alone (`step`), then 3 and 1
        assert [len(e) for e in steps["globex"].values()] == [3]
        # the background loop's pull counts by events, as when each event was a step; its Fisher's
        # refresh by updates (the weights move once an update)
        assert learner._pending == {"acme": 5, "globex": 3}
        assert {t: learner._tenants[t].since_fisher for t in steps} == {"acme": 3, "globex": 1}

        assert _complete(running, "initech", ASKED["acme"][0])[1:] == other_before  # bitwise

        running.app.state.ruvllm.service.witness.flush()
        path = Path(running.cfg.witness_log)
        assert verify(path).ok
        entries = [e for ids in asked.values() for rid in ids for e in find(path, rid) if e.kind == "feedback"]
        assert sorted((e.body["adapter_version"], e.body["loss"]) for e in entries) == \
            sorted((b["adapter"], b["loss"]) for b in bodies)  # every event witnessed, with its own answer

        # By hand: the same events through `step` (alone) and `step_events` (together), from fresh
        # states: the same weights, bitwise, and each event's own loss.
        by_hand = InstantLearner(learner.layers, learner.instant.config)
        for tenant, by_version in steps.items():
            state = by_hand.new_tenant(_seed(tenant))
            anchors = [make_anchor(learner.layers, by_hand.prepare(c.prompt_ids, c.output_ids, "full"), instant.kl_top)
                       for c in learner.store.recent(tenant, instant.kl_samples)]

            def kl(lora: MicroLora) -> torch.Tensor:
                return instant.kl_weight * kl_mean(learner.layers, lora, anchors, 0, torch.Generator())
            for events in by_version.values():
                preps = []
                for i in events:
                    tenant_, which, score, correction = EVENTS[i]
                    done = learner.store.get(asked[tenant_][which], tenant_)
                    target = learner.tokenizer.encode(correction, add_special_tokens=False) + [learner.eos] \
                        if correction else done.output_ids
                    preps.append((by_hand.prepare(done.prompt_ids, target), score))
                if len(preps) == 1:
                    losses = [by_hand.step(state, *preps[0], kl).loss]
                else:
                    losses = by_hand.step_events(state, preps, kl).losses
                assert [bodies[i]["loss"] for i in events] == losses
            served = learner._tenants[tenant].lora.parameters()
            assert all(torch.equal(a, b) for a, b in zip(served, state.lora.parameters()))
