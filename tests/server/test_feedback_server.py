"""POST /v1/feedback through the real `openai` client's HTTP (tiny model): a tenant's corrections
are learned and served to it at once while another tenant's outputs stay bitwise the same; unknown,
expired and other tenants' ids are 404 alike, a bad score 400, too much feedback 429; feedback is
witnessed; a server without --learn answers 400."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from ruvllm import LLM
from ruvllm.learning.config import InstantConfig, LearningConfig
from ruvllm.server.tenants import read_api_keys
from ruvllm.witness.log import find, verify
from tests.server.conftest import MODEL, RunningServer, start_server

PROMPT = [5, 80, 23, 311, 42, 17, 260, 9, 131, 77]


@pytest.fixture(scope="module")
def lora_llm(tiny_model_dir: Path) -> LLM:
    return LLM(str(tiny_model_dir), enable_lora=True, max_loras=4, max_lora_rank=4, quantization="none")


@pytest.fixture
def server(lora_llm: LLM, tmp_path: Path) -> Iterator[RunningServer]:
    (tmp_path / "keys").write_text("key-a acme\nkey-b globex\n")
    learning = LearningConfig(instant=InstantConfig(layers=1, lr=5e-2, candidates=0), root=str(tmp_path / "learned"))
    yield from start_server(lora_llm, api_keys=read_api_keys(tmp_path / "keys"), learning=learning,
                            feedback_rate=0.5, feedback_burst=12, witness_log=str(tmp_path / "w.sqlite3"))


def _complete(server: RunningServer, key: str) -> tuple[str, list[int], list]:
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0)
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=1,
                                    extra_body={"ignore_eos": True})
    choice = out.choices[0]
    return out.id, choice.logprobs.tokens, choice.logprobs.token_logprobs


def _feedback(server: RunningServer, key: str, **body: object) -> httpx.Response:
    return httpx.post(server.url + "/v1/feedback", json=body, headers={"Authorization": f"Bearer {key}"}, timeout=60)


def test_feedback_teaches_its_tenant_only(server: RunningServer) -> None:
    other_before = _complete(server, "key-b")[1:]
    rid, tokens, _ = _complete(server, "key-a")
    for _ in range(10):
        r = _feedback(server, "key-a", id=rid, score=1.0, correction="t7 t7 t7 t7")
        assert r.status_code == 200, r.text
    assert r.json()["adapter"] == "learned:acme:v10" and r.json()["update_ms"] > 0
    taught = _complete(server, "key-a")[1]
    assert taught[:4] == ["t7"] * 4 and tokens[:4] != taught[:4]
    assert _complete(server, "key-b")[1:] == other_before  # bitwise: tokens and logprobs

    assert _feedback(server, "key-b", id=rid, score=1.0).status_code == 404  # acme's, not globex's
    assert _feedback(server, "key-a", id="cmpl-nope", score=1.0).status_code == 404
    bad = _feedback(server, "key-a", id=rid, score=3.0)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "score"
    assert _feedback(server, "key-a", id=rid).status_code == 400  # no score at all
    codes = [_feedback(server, "key-a", id=rid, score=1.0).status_code for _ in range(3)]
    assert 429 in codes  # 12 events of burst spent, at 0.5 a second
    for score in (True, "1"):  # issue 33: both were taken as 1.0
        assert _feedback(server, "key-a", id=rid, score=score).json()["error"]["param"] == "score"
    assert _feedback(server, "key-b", id=_complete(server, "key-b")[0], score=1.0).status_code == 200  # its own bucket

    server.app.state.ruvllm.service.witness.flush()
    path = Path(server.cfg.witness_log)
    assert verify(path).ok
    kinds = [e.kind for e in find(path, rid)]
    assert kinds.count("completion") == 1 and kinds.count("feedback") >= 10


def test_the_background_loop_consolidates_on_its_own(lora_llm: LLM, tmp_path: Path) -> None:
    """With a background interval, the server's thread consolidates a tenant's updates under EWC++
    (once it has everyday completions for a Fisher) and serves the result as a `background` version;
    the other tenant stays bitwise the same."""
    import time

    (tmp_path / "keys").write_text("key-a acme\nkey-b globex\n")
    learning = LearningConfig(instant=InstantConfig(layers=1, lr=5e-2, candidates=0, ewc_lambda=1e5),
                              root=str(tmp_path / "learned"), background_s=0.05)
    for running in start_server(lora_llm, api_keys=read_api_keys(tmp_path / "keys"), learning=learning):
        other_before = _complete(running, "key-b")[1:]
        _complete(running, "key-a")  # everyday traffic: what the Fisher is made of
        rid = _complete(running, "key-a")[0]
        assert _feedback(running, "key-a", id=rid, score=1.0, correction="t7 t7 t7").status_code == 200
        learner = running.app.state.ruvllm.service.learner
        deadline = time.monotonic() + 30
        while not any(v.source == "background" for v in learner.policy.versions("acme")):
            assert time.monotonic() < deadline, "no consolidation within 30 s"
            time.sleep(0.05)
        assert learner.policy.versions("acme")[-1].source == "background"
        assert learner.adapter_for("acme") == "learned:acme:v2"
        _complete(running, "key-a")  # served with the consolidated version
        assert _complete(running, "key-b")[1:] == other_before


def test_feedback_is_refused_while_learning_is_behind(lora_llm: LLM, tmp_path: Path) -> None:
    """With no room for another queued update, feedback is a 429 that says learning is behind."""
    learning = LearningConfig(instant=InstantConfig(layers=1, candidates=0), root=str(tmp_path / "learned"))
    for running in start_server(lora_llm, learning=learning, max_waiting_updates=0):
        rid = _complete(running, "x")[0]
        r = _feedback(running, "x", id=rid, score=1.0)
        assert r.status_code == 429 and "learning is behind" in r.json()["error"]["message"]


def test_without_learning_feedback_is_refused(lora_llm: LLM) -> None:
    for running in start_server(lora_llm):
        r = httpx.post(running.url + "/v1/feedback", json={"id": "x", "score": 1}, timeout=30)
        assert r.status_code == 400 and "--learn" in r.json()["error"]["message"]


def test_the_deep_loop_runs_after_enough_feedback(lora_llm: LLM, tmp_path: Path) -> None:
    """--deep-every 3: once a tenant's feedback weighs 3 (two ratings of 0.5 weigh one correction),
    `ruvllm learn run` starts in a process of its own; its verdict lands in the policy store's
    history and the witness log."""
    (tmp_path / "keys").write_text("key-a acme\n")
    heldout = tmp_path / "heldout.txt"
    heldout.write_text(" ".join(f"t{i % 400 + 5}" for i in range(300)))
    learning = LearningConfig(instant=InstantConfig(layers=1, lr=5e-2, candidates=0), root=str(tmp_path / "learned"))
    for running in start_server(lora_llm, api_keys=read_api_keys(tmp_path / "keys"), learning=learning,
                                witness_log=str(tmp_path / "w.sqlite3"), deep_every=3, deep_heldout=str(heldout)):
        rid = _complete(running, "key-a")[0]
        for i, body in enumerate([{"score": 0.5}, {"score": -0.5}] + [{"score": 1.0, "correction": "t7 t7 t7"}] * 2):
            assert _feedback(running, "key-a", id=rid, **body).status_code == 200
            assert len(running.app.state.ruvllm.feedback.deep.runs) == (1 if i == 3 else 0)
        (tenant, proc), = running.app.state.ruvllm.feedback.deep.runs
        code = proc.wait(timeout=300)
        learner = running.app.state.ruvllm.service.learner
        actions = [h[2] for h in learner.policy.history("acme")]
        promoted = any(v.source == "deep" for v in learner.policy.versions("acme"))
        # exit 0 with a deep version, or 1 with a recorded refusal (a crash records neither)
        assert tenant == "acme" and (code, promoted, "refused" in actions) in ((0, True, False), (1, False, True))
        running.app.state.ruvllm.service.witness.flush()
        (entry,) = find(tmp_path / "w.sqlite3", "deep:acme")
        assert entry.kind == "promotion" and verify(tmp_path / "w.sqlite3").ok  # two writers, one chain


def test_learned_adapters_belong_to_their_tenant(lora_llm: LLM, tmp_path: Path) -> None:
    """Issue 33, item 13, as the attack went: globex's key must not list, use, unload or replace
    acme's learned adapter, and the admin key with `user: acme` is not acme."""
    (tmp_path / "keys").write_text("key-a acme\nkey-b globex\n")
    learning = LearningConfig(instant=InstantConfig(layers=1, lr=5e-2, candidates=0), root=str(tmp_path / "learned"))
    for running in start_server(lora_llm, api_keys=read_api_keys(tmp_path / "keys"), learning=learning,
                                admin_key="admin"):
        base = _complete(running, "admin")[1:]
        rid = _complete(running, "key-a")[0]
        for _ in range(2):
            r = _feedback(running, "key-a", id=rid, score=1.0, correction="t7 t7 t7 t7")
        assert r.status_code == 200 and r.json()["adapter"] == "learned:acme:v2"
        taught = _complete(running, "key-a")[1:]
        assert taught != base

        def models(key: str) -> set[str]:
            return {m.id for m in openai.OpenAI(base_url=running.url + "/v1", api_key=key).models.list()}

        assert "learned:acme:v2" in models("key-a")
        assert not any(m.startswith("learned:") for m in models("key-b") | models("admin"))

        def ask(key: str, model: str) -> httpx.Response:
            return httpx.post(running.url + "/v1/completions", headers={"Authorization": f"Bearer {key}"},
                              json={"model": model, "prompt": PROMPT, "max_tokens": 2}, timeout=60)

        absent = ask("key-b", "learned:acme:v99")
        for key in ("key-b", "admin"):
            r = ask(key, "learned:acme:v2")
            assert r.status_code == 404
            assert r.json() == absent.json() | {"error": {**absent.json()["error"], "message": absent.json()[
                "error"]["message"].replace("v99", "v2")}}  # the same answer as a name nobody loaded
        with pytest.raises(openai.NotFoundError):
            openai.OpenAI(base_url=running.url + "/v1", api_key="key-b", max_retries=0).completions.create(
                model="learned:acme:v2", prompt=PROMPT, max_tokens=2)

        def admin_route(key: str, path: str, **body: str) -> httpx.Response:
            return httpx.post(running.url + path, json=body, headers={"Authorization": f"Bearer {key}"}, timeout=60)

        assert admin_route("key-b", "/v1/unload_lora_adapter", lora_name="learned:acme:v2").status_code == 403
        for path, body in (("/v1/unload_lora_adapter", {}), ("/v1/load_lora_adapter", {"lora_path": str(tmp_path)})):
            r = admin_route("admin", path, lora_name="learned:acme:v2", **body)
            assert r.status_code == 403 and r.json()["error"]["code"] == "reserved_name"
        assert "learned:acme:v2" in running.engine.loras

        admin_as_acme = openai.OpenAI(base_url=running.url + "/v1", api_key="admin", max_retries=0).completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=1, user="acme",
            extra_body={"ignore_eos": True}).choices[0].logprobs
        assert [admin_as_acme.tokens, admin_as_acme.token_logprobs] == list(base)  # the base model, not acme's
        assert _complete(running, "key-a")[1:] == taught


SHARED = {"api_key": "k", "admin_key": "a"}  # a shared key that is not the operator's: `user` names the tenant


@pytest.mark.parametrize("kwargs, status", [({}, 200), (SHARED, 403), ({**SHARED, "learn_user_tenants": True}, 200),
                                            ({"learn_user_tenants": False}, 403)])
def test_user_tenants_learn_only_where_the_operator_allows(lora_llm: LLM, tmp_path: Path, kwargs: dict,
                                                           status: int) -> None:
    """Issue 33, item 2: a tenant named by `user` (one client could name thousands) learns by default
    only on a server without keys; refused, it is a 403 that names --learn-user-tenants, while the
    default tenant still learns."""
    learning = LearningConfig(instant=InstantConfig(layers=1, candidates=0), root=str(tmp_path / "learned"))
    for running in start_server(lora_llm, learning=learning, **kwargs):
        def ask(path: str, **body: object) -> httpx.Response:
            return httpx.post(running.url + path, json=body, headers={"Authorization": "Bearer k"}, timeout=60)

        rid = ask("/v1/completions", model=MODEL, prompt=PROMPT, max_tokens=2, user="acme").json()["id"]
        r = ask("/v1/feedback", id=rid, score=1.0, user="acme")
        assert r.status_code == status, r.text
        if status == 403:
            assert r.json()["error"]["param"] == "user" and "--learn-user-tenants" in r.json()["error"]["message"]
            rid = ask("/v1/completions", model=MODEL, prompt=PROMPT, max_tokens=2).json()["id"]
            assert ask("/v1/feedback", id=rid, score=1.0).json()["adapter"] == "learned:default:v1"
        else:
            assert r.json()["adapter"] == "learned:acme:v1"
