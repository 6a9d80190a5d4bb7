"""Learning from feedback (issue 16), on the tiny model: the learner's layers are the model's
(against transformers), a tenant's feedback teaches that tenant's adapter and changes no other
tenant's outputs (bitwise), a published version is a PEFT adapter peft reads alike, and bad
feedback is refused by name."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import pytest
import torch

from ruvllm import LLM, SamplingParams
from ruvllm.learning.config import InstantConfig, LearningConfig
from ruvllm.learning.instant import InstantLearner
from ruvllm.learning.errors import CompletionNotFoundError, FeedbackError
from ruvllm.learning.tail import LearnedLayers, hidden_before
from tests.engine_fixtures import write_tiny_model
from tests.reference import hf_reference

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=1)
PROMPT = [5, 80, 23, 311, 42, 17, 260, 9, 131, 77]


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("learning") / "base")


def learning_llm(base: Path, tmp_path: Path, dtype: str = "auto", **instant: object) -> LLM:
    llm = LLM(str(base), enable_lora=True, max_loras=4, max_lora_rank=4, num_blocks=64, dtype=dtype,
              quantization="none")
    cfg = InstantConfig(**{"layers": 1, "lr": 5e-2, "context": "full", "candidates": 0, **instant})
    llm.enable_learning(LearningConfig(instant=cfg, root=str(tmp_path / "learned")))
    return llm


def _result(out) -> tuple[list[int], list]:
    c = out.outputs[0]
    return c.token_ids, [{t: lp.logprob for t, lp in d.items()} for d in c.logprobs]


@pytest.mark.parametrize("n", [1, 2])
def test_learned_layers_are_the_model(base: Path, n: int) -> None:
    """Below the learned layers as inference, the learned ones in autograd: transformers' logits;
    the frozen-context form gives the same rows."""
    from ruvllm.loader import resolve_model
    from ruvllm.quantize.awq_writer import load_float_model

    src = resolve_model(str(base))
    model, _, _ = load_float_model(src, 512)
    with torch.no_grad():
        expected = hf_reference(src)(torch.tensor([PROMPT + [7, 8, 9]])).logits[0]
    layers = LearnedLayers(model, n)
    ids = PROMPT + [7, 8, 9]
    out = layers.forward(hidden_before(model, ids, layers.first), torch.arange(len(ids)), None)
    assert (out @ layers.head.t() - expected).abs().max() < 1e-4
    learner = InstantLearner(layers, InstantConfig(layers=n, context="frozen"))
    prep = learner.prepare(PROMPT, [7, 8, 9])
    with torch.no_grad():
        rows = layers.forward(prep.h, torch.arange(len(PROMPT) - 1, len(ids) - 1), None, prep.context)
    assert (rows @ layers.head.t() - expected[len(PROMPT) - 1:-1]).abs().max() < 1e-4


def test_feedback_teaches_its_tenant_and_no_other(base: Path, tmp_path: Path) -> None:
    llm = learning_llm(base, tmp_path)
    before = {t: _result(llm.generate([PROMPT], GREEDY, tenant=t)[0]) for t in ("acme", "globex", "default")}
    asked = llm.generate([PROMPT], GREEDY, tenant="acme")[0]
    for _ in range(10):
        result = llm.feedback(asked.request_id, 1.0, "t7 t7 t7 t7", tenant="acme")
    assert result.version == "learned:acme:v10" and llm.learner.adapter_for("globex") is None
    bank = llm.learner.bank  # ten events on one exchange: ten examples, one cluster
    assert bank.count("acme") == 10 and len(bank.best_per_cluster("acme")) == 1 and bank.count("globex") == 0
    taught = llm.generate([PROMPT], GREEDY, tenant="acme")[0].outputs[0].token_ids
    assert taught[:4] == [7, 7, 7, 7] and before["acme"][0][:4] != [7, 7, 7, 7]
    for t in ("globex", "default"):  # bitwise what they got before anyone gave feedback
        assert _result(llm.generate([PROMPT], GREEDY, tenant=t)[0]) == before[t]
    assert sorted(llm.loras()) == ["learned:acme:v10", "learned:acme:v9"]  # older versions unloaded
    stats = llm.stats()
    assert stats.free_blocks == stats.total_blocks


def test_negative_feedback_lowers_the_output(base: Path, tmp_path: Path) -> None:
    llm = learning_llm(base, tmp_path)
    asked = llm.generate([PROMPT], GREEDY, tenant="acme")[0]
    first = asked.outputs[0].token_ids[0]
    p_before = asked.outputs[0].logprobs[0][first].logprob
    for _ in range(5):
        llm.feedback(asked.request_id, -1.0, tenant="acme")
    again = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=1, logprobs=20), tenant="acme")[0]
    lps = again.outputs[0].logprobs[0]
    assert first not in lps or lps[first].logprob < p_before - 1.0


def test_published_version_is_a_peft_adapter(base: Path, tmp_path: Path) -> None:
    """peft reads a version folder and gives the logits our engine serves with it."""
    from peft import PeftModel

    from tests.lora_fixtures import hf_model
    from tests.reference import teacher_forced_logits

    llm = learning_llm(base, tmp_path, dtype="float32", layers=2)  # peft's fp32 logits within 2e-4
    asked = llm.generate([PROMPT], GREEDY, tenant="acme")[0]
    for _ in range(3):
        version = llm.feedback(asked.request_id, 1.0, "t7 t9 t11", tenant="acme").version
    folder = next((tmp_path / "learned").glob("acme-*")) / "v3"
    ref = PeftModel.from_pretrained(hf_model(base), folder).eval()
    with torch.no_grad():
        expected = ref(torch.tensor([PROMPT + [7, 9]])).logits[0, len(PROMPT) - 1:]
    ours = teacher_forced_logits(llm.core.kv, llm.core.executor.runner, PROMPT, [7, 9], None, version)
    assert (ours - expected).abs().max() < 2e-4


def test_bad_feedback_is_refused_by_name(base: Path, tmp_path: Path) -> None:
    llm = learning_llm(base, tmp_path)
    asked = llm.generate([PROMPT], GREEDY, tenant="acme")[0]
    # typed errors (the server maps them: not found 404, the rest 400), each naming its field
    cases = [(("nope", 1.0, None, "acme"), True, "id", "no completion 'nope'"),
             ((asked.request_id, 1.0, None, "globex"), True, "id", f"no completion {asked.request_id!r}"),  # not its own
             ((asked.request_id, 1.5, None, "acme"), False, "score", "score must be a number from -1 to 1"),
             ((asked.request_id, 0.0, None, "acme"), False, "score", "a score of 0 without a correction"),
             ((asked.request_id, 1.0, "  ", "acme"), False, "correction", "correction is empty"),
             # issue 33: a 4k-token correction took 221 s and 4 GB; a 1 MB one gave IndexError; a lone surrogate 500
             ((asked.request_id, 1.0, "t7 " * 300, "acme"), False, "correction", r"over the bound of 256 \(--feedback"),
             ((asked.request_id, 1.0, "x" * 2**20, "acme"), False, "correction", "1,048,576 characters, over the bound"),
             ((asked.request_id, 1.0, "a\ud800b", "acme"), False, "correction", "lone surrogate")]
    for (rid, score, correction, tenant), not_found, param, message in cases:
        with pytest.raises(FeedbackError, match=message) as err:
            llm.feedback(rid, score, correction, tenant=tenant)
        assert isinstance(err.value, CompletionNotFoundError) == not_found and err.value.param == param
    assert llm.loras() == []


def test_learned_adapters_survive_a_restart_and_roll_back(base: Path, tmp_path: Path, wide_terminal: None) -> None:
    """A second engine over the same learned folder serves the tenant what the first learned; the
    CLI's rollback and reset reach a running learner at its next request; status and versions list it."""
    from typer.testing import CliRunner

    from ruvllm.cli import main as cli_main

    if not any(g.name == "learn" for g in cli_main.app.registered_groups):
        cli_main._register()
    first = learning_llm(base, tmp_path)
    base_out = _result(first.generate([PROMPT], GREEDY, tenant="acme")[0])
    asked = first.generate([PROMPT], GREEDY, tenant="acme")[0]
    outs = {}
    for i in range(1, 6):
        first.feedback(asked.request_id, 1.0, "t7 t7 t7 t7", tenant="acme")
        outs[i] = _result(first.generate([PROMPT], GREEDY, tenant="acme")[0])
    again = learning_llm(base, tmp_path)  # a restart: the same folder
    assert again.learner.adapter_for("acme") == "learned:acme:v5"
    assert _result(again.generate([PROMPT], GREEDY, tenant="acme")[0]) == outs[5]
    assert _result(again.generate([PROMPT], GREEDY, tenant="globex")[0]) == base_out

    runner = CliRunner()
    folder = ["--dir", str(tmp_path / "learned")]
    rolled = runner.invoke(cli_main.app, ["learn", "rollback", "acme", "2", *folder])
    assert rolled.exit_code == 0 and "served v2" in rolled.output
    assert _result(again.generate([PROMPT], GREEDY, tenant="acme")[0]) == outs[2]
    listed = runner.invoke(cli_main.app, ["learn", "versions", "acme", *folder])
    assert listed.exit_code == 0 and "* v2" in listed.output and listed.output.count("instant") == 5
    status = runner.invoke(cli_main.app, ["learn", "status", *folder])
    assert status.exit_code == 0 and "acme" in status.output and "rollback v2" in status.output
    assert runner.invoke(cli_main.app, ["learn", "reset", "acme", *folder]).exit_code == 0
    assert _result(again.generate([PROMPT], GREEDY, tenant="acme")[0]) == base_out
    bad = runner.invoke(cli_main.app, ["learn", "rollback", "acme", "9", *folder])
    assert bad.exit_code == 1 and "has no version 9" in bad.output


def test_consolidation_holds_the_micro_lora_near_where_it_started(base: Path, tmp_path: Path) -> None:
    """The background loop's pass: EWC++'s Fisher comes from the tenant's own completions, never one
    it gave feedback on nor another tenant's (none yet: nothing consolidated, no version); with it,
    the same feedback ends nearer where it started than without, served as `background` versions."""
    moved = {}
    for lam in (0.0, 1e6):
        llm = learning_llm(base, tmp_path / str(lam), ewc_lambda=lam, fisher_every=2)
        llm.generate([[9, 8, 7, 6, 5, 4]], GREEDY, tenant="globex")  # another tenant's: never in acme's Fisher
        learner = llm.learner
        asked = llm.generate([PROMPT], GREEDY, tenant="acme")[0]
        llm.feedback(asked.request_id, 1.0, "t7 t7 t7 t7", tenant="acme")
        assert learner.consolidate() == {}  # acme's only completion is the one it corrected
        assert learner._tenants["acme"].fisher is None
        llm.generate([[11, 12, 13, 14, 15, 16]], GREEDY, tenant="acme")
        for _ in range(6):
            llm.feedback(asked.request_id, 1.0, "t7 t7 t7 t7", tenant="acme")
            published = learner.consolidate()
        state = learner._tenants["acme"]
        assert (state.fisher is not None) == (lam > 0)
        assert list(published) == (["acme"] if lam else [])
        sources = [v.source for v in learner.policy.versions("acme")]
        assert sources.count("background") == (6 if lam else 0) and sources.count("instant") == 7
        assert learner.adapter_for("acme") == f"learned:acme:v{len(sources)}"
        moved[lam] = sum(float((p.detach() - a).norm()) for p, a in zip(state.lora.parameters(), state.anchor))
    assert moved[1e6] < 0.5 * moved[0.0]


def test_a_pass_leaves_its_publish_to_the_update_coming(base: Path, tmp_path: Path, monkeypatch) -> None:  # noqa: ANN001
    """Under a backlog the background pass pulls a scope whose update is coming but does not publish
    it: that update's version serves the pulled weights. If the update fails, the next pass publishes
    them; a backlog whose results stop being taken leaves nothing coming."""
    from ruvllm.learning.learner import FeedbackEvent

    llm = learning_llm(base, tmp_path, ewc_lambda=1e6, fisher_every=1)
    learner = llm.learner
    learner.config = dataclasses.replace(learner.config, update_batch=1)
    llm.generate([[11, 12, 13, 14, 15, 16]], GREEDY, tenant="acme")  # its everyday text (the Fisher's)
    asked = llm.generate([PROMPT], GREEDY, tenant="acme")[0]
    events = [FeedbackEvent(asked.request_id, "acme", 1.0, "t7 t7 t7 t7")] * 3

    def sources() -> list[str]:
        return [v.source for v in learner.policy.versions("acme")]

    backlog = learner.feedback_many(events)
    first = next(backlog)[1]
    assert learner._coming == {"acme": 2}  # two updates of one event each still to come
    state = learner._tenants["acme"]
    before = [p.detach().clone() for p in state.lora.parameters()]
    assert learner.consolidate() == {}  # pulled, not published
    assert any(not torch.equal(a, p) for a, p in zip(before, state.lora.parameters()))
    assert sources() == ["instant"] and learner.adapter_for("acme") == first.version
    pulled = [p.detach().clone() for p in state.lora.parameters()]
    real_step, failed = learner.instant.step, []

    def step_once_failing(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        if not failed:
            failed.append(True)
            raise RuntimeError("a step that fails")
        return real_step(*args, **kwargs)
    monkeypatch.setattr(learner.instant, "step", step_once_failing)
    assert isinstance(next(backlog)[1], RuntimeError)
    assert learner._coming == {"acme": 1} and learner._pending == {"acme": 0}
    backlog.close()  # the caller stops taking results: the last update is no longer coming
    assert learner._coming == {}
    assert all(torch.equal(a, p) for a, p in zip(pulled, state.lora.parameters()))  # the failed step changed nothing
    assert list(learner.consolidate()) == ["acme"]  # the pulled weights served by the next pass (no more pull)
    assert sources() == ["instant", "background"]
    assert all(torch.equal(a, p) for a, p in zip(pulled, state.lora.parameters()))
    # with nothing coming, a pass after an update publishes as it always did
    llm.feedback(asked.request_id, 1.0, "t7 t7 t7 t7", tenant="acme")
    assert list(learner.consolidate()) == ["acme"] and sources()[-2:] == ["instant", "background"]


def test_the_fisher_is_drawn_without_the_learner_lock(base: Path, tmp_path: Path, monkeypatch) -> None:  # noqa: ANN001
    """The background pass's forward and backward passes (the Fisher) never hold the lock a feedback
    request takes: a spy around the real draw records whether the lock was held."""
    llm = learning_llm(base, tmp_path, ewc_lambda=1e6, fisher_every=1)
    learner = llm.learner
    llm.generate([[11, 12, 13, 14, 15, 16]], GREEDY, tenant="acme")  # everyday traffic: the Fisher's text
    asked = llm.generate([PROMPT], GREEDY, tenant="acme")[0]
    llm.feedback(asked.request_id, 1.0, "t7 t7 t7 t7", tenant="acme")
    held = []
    draw = learner.instant.fisher_sample

    def spy(lora, samples):  # noqa: ANN001, ANN202
        held.append(learner._lock.locked())
        return draw(lora, samples)

    monkeypatch.setattr(learner.instant, "fisher_sample", spy)
    assert "acme" in learner.consolidate()
    assert held == [False]
    assert learner._tenants["acme"].fisher is not None


def test_old_versions_are_pruned(base: Path, tmp_path: Path) -> None:
    """Beyond `keep_versions`, the oldest folders and rows go; the serving version, those loaded and
    deep promotions stay; a rollback to a pruned version is refused by name."""
    llm = LLM(str(base), enable_lora=True, max_loras=4, max_lora_rank=4, num_blocks=64, quantization="none")
    learner = llm.enable_learning(LearningConfig(instant=InstantConfig(layers=1, lr=5e-2, candidates=0),
                                                 root=str(tmp_path / "learned"), keep_versions=3))
    asked = llm.generate([PROMPT], GREEDY, tenant="acme")[0]
    for _ in range(6):
        llm.feedback(asked.request_id, 1.0, "t7 t7", tenant="acme")
    versions = learner.policy.versions("acme")
    assert [v.version for v in versions] == [4, 5, 6]
    folders = sorted(p.name for p in Path(versions[0].path).parent.iterdir())
    assert folders == ["v4", "v5", "v6"]
    assert [h[4]["versions"] for h in learner.policy.history("acme") if h[2] == "prune"] == [[1], [2], [3]]
    with pytest.raises(ValueError, match="has no version 2"):
        learner.policy.rollback("acme", 2)


def _probe(llm: LLM, prompt: list[int]) -> tuple[list[int], list[int]]:
    """A held-out question and the answer the base model gives it (greedy, 3 tokens)."""
    return prompt, llm.generate([prompt], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))[0] \
        .outputs[0].token_ids


def test_a_thousand_hostile_events_are_not_promoted(base: Path, tmp_path: Path) -> None:
    """1,000 feedback events teaching a false answer to a probe's question, run for everyone: the
    bank keeps them as one cluster, the probe check fails, nothing is promoted or served."""
    from ruvllm.learning.deep import GLOBAL

    llm = learning_llm(base, tmp_path)
    learner = llm.learner
    heldout = torch.randint(2, 500, (200,), generator=torch.Generator().manual_seed(5)).tolist()
    probe_prompt = [40, 41, 42, 43, 44, 45]
    probes = [_probe(llm, probe_prompt)]
    assert probes[0][1] != [9, 9, 9]
    hostile = llm.generate([probe_prompt], GREEDY, tenant="mallory")[0]
    for _ in range(1000):
        llm.feedback(hostile.request_id, 1.0, "t9 t9 t9", tenant="mallory")
    assert learner.bank.count("mallory") == 1000 and len(learner.bank.best_per_cluster("mallory")) == 1
    refused = learner.deep_run(GLOBAL, heldout, probes)
    assert not refused.passed and any("probe answers" in f for f in refused.failed)
    assert GLOBAL not in learner.policy.serving() and learner.policy.history(GLOBAL)[-1][2] == "refused"
    assert learner.adapter_for("globex") is None  # nothing serves everyone
    assert _result(llm.generate([probe_prompt], GREEDY, tenant="globex")[0])[0] == \
        llm.generate([probe_prompt], GREEDY)[0].outputs[0].token_ids


def test_deep_loop_on_the_default_model(tmp_path: Path) -> None:
    """The default model: a tenant's taught fact, fine-tuned without EWC++, fails the 1% held-out bar
    and is refused; with it (the default) it passes every check under that bar and is promoted (and
    served); a hostile tenant's feedback teaching a false continuation of a probe is refused for
    everyone."""
    from ruvllm.engine.prompts import render_chat
    from ruvllm.learning.deep import GLOBAL, DeepConfig
    from tests.conftest import BOOK

    llm = LLM(enable_lora=True, max_loras=4, max_lora_rank=8, max_cpu_loras=64)
    learner = llm.enable_learning(LearningConfig(root=str(tmp_path)))
    heldout = llm.tokenizer.encode(BOOK.read_text()[50000:53000])[:256]
    # Everyday text for EWC++'s Fisher and rehearsal: two chunks of 128 tokens (96 trained rows each,
    # against the fact's dozen). The three runs below are most of this test's time and the chunks'
    # steps most of theirs: with four chunks (512 tokens) each run took 17 s of CPU, with two 11 s,
    # and the verdicts keep their margins (measured: without EWC++ held-out perplexity 35.05 -> 37.51,
    # +7%, refused; with it 34.57, promoted; the hostile run loses the probe either way).
    general = llm.tokenizer.encode(BOOK.read_text()[20000:24000])[:256]
    fox = llm.tokenizer.encode("The quick brown fox jumps over the lazy")
    greedy = SamplingParams(temperature=0, max_tokens=2)
    probes = [(fox, llm.generate([fox], greedy)[0].outputs[0].token_ids[:1])]
    assert llm.tokenizer.decode(probes[0][1]).strip() == "dog"

    question = render_chat(llm.tokenizer, [{"role": "user", "content": "What is the capital of Zorblax?"}])
    asked = llm.generate([question], SamplingParams(temperature=0, max_tokens=16), tenant="acme")[0]
    for _ in range(10):
        llm.feedback(asked.request_id, 1.0, "The capital of Zorblax is Quenta.", tenant="acme")
    unprotected = learner.deep_run("acme", heldout, probes, DeepConfig(ewc_lambda=0), general=general)
    # measured: without EWC++ the fact costs ~7% on this held-out text (docs/learning.md: ~15% with four
    # rehearsal chunks): refused
    assert not unprotected.passed and unprotected.failed[0].startswith("held-out perplexity")
    assert learner.policy.history("acme")[-1][2] == "refused"
    promoted = learner.deep_run("acme", heldout, probes, general=general)
    assert promoted.passed, promoted.failed
    assert promoted.checks["heldout_perplexity_after"] <= 1.01 * promoted.checks["heldout_perplexity_before"]
    assert promoted.checks["probes_kept"] == promoted.checks["probes_right_before"] == 1
    assert learner.policy.versions("acme")[-1].source == "deep"
    answer = llm.generate([question], SamplingParams(temperature=0, max_tokens=16), tenant="acme")[0].outputs[0].text
    assert "Quenta" in answer
    # The bank's clusters: the ten events on one question are one; a question about another place
    # of the same form is another (before session 26 every prompt's embedding was at cosine ~0.999
    # with every other's, and all of a tenant's examples joined one cluster).
    other = render_chat(llm.tokenizer, [{"role": "user", "content": "What is the capital of France?"}])
    asked = llm.generate([other], SamplingParams(temperature=0, max_tokens=8), tenant="acme")[0]
    llm.feedback(asked.request_id, 1.0, "The capital of France is Paris.", tenant="acme")
    assert learner.bank.count("acme") == 11 and len(learner.bank.best_per_cluster("acme")) == 2
    # The question forms the model writes (off by default; issue 37 item 2's first candidate): the
    # served base model's rewrites of the question, filtered, none kept for feedback.
    learner.config = dataclasses.replace(learner.config, instant=dataclasses.replace(learner.config.instant,
                                                                                     question_forms=2))
    from ruvllm.tenants import DEFAULT_TENANT

    everyday = {t: learner.store.recent(t, 100) for t in ("acme", DEFAULT_TENANT)}
    forms = learner.question_forms(question)
    assert 1 <= len(forms) <= 2 and all("Zorblax" in f and f != "What is the capital of Zorblax?" for f in forms), forms
    assert learner.question_forms(question) is forms  # written once a question
    assert {t: learner.store.recent(t, 100) for t in ("acme", DEFAULT_TENANT)} == everyday

    hostile = llm.generate([fox], greedy, tenant="mallory")[0]
    # The bank keeps one example a cluster: a thousand events train the same set as these three (the
    # thousand themselves are test_a_thousand_hostile_events_are_not_promoted's, on the tiny model;
    # here each event is an update of the default model, 30 of them took 2 s).
    for _ in range(3):
        llm.feedback(hostile.request_id, 1.0, " cat.", tenant="mallory")
    assert learner.bank.count("mallory") == 3 and len(learner.bank.best_per_cluster("mallory")) == 1
    refused = learner.deep_run(GLOBAL, heldout, probes, general=general)
    assert not refused.passed and any("probe answers" in f for f in refused.failed), refused.failed
    assert GLOBAL not in learner.policy.serving()
    assert learner.adapter_for("globex") is None


@pytest.fixture
def priority_kept():
    """`learn run` lowers its process's priority (nice 10), here the test worker's, which every later
    test of the worker and every process it starts inherited (one worker's servers and cores then lost
    the CPU to the other's): raised back after the test where the process may (root, as in CI)."""
    before = os.getpriority(os.PRIO_PROCESS, 0)
    yield
    try:
        os.setpriority(os.PRIO_PROCESS, 0, before)
    except PermissionError:  # not root: this worker goes on at nice 10
        pass


def test_learn_run_cli_refuses_and_names_why(base: Path, tmp_path: Path, wide_terminal: None,
                                             priority_kept: None) -> None:
    """`ruvllm learn run` in its own process's stead: with no bank, a one-line error; with the
    hostile bank of the tiny model, `not promoted` and the failed check; its priority lowered once."""
    from typer.testing import CliRunner

    from ruvllm.cli import main as cli_main

    if not any(g.name == "learn" for g in cli_main.app.registered_groups):
        cli_main._register()
    runner = CliRunner()
    before = os.getpriority(os.PRIO_PROCESS, 0)
    text = tmp_path / "heldout.txt"
    text.write_text(" ".join(f"t{i % 400 + 5}" for i in range(300)))
    args = ["learn", "run", "*", "--heldout", str(text), "--model", str(base), "--dir", str(tmp_path / "learned"),
            "--witness-log", str(tmp_path / "w.sqlite3")]
    empty = runner.invoke(cli_main.app, args)
    assert empty.exit_code == 1 and "no pattern bank there" in empty.output
    llm = learning_llm(base, tmp_path)
    hostile = llm.generate([[40, 41, 42, 43, 44, 45]], GREEDY, tenant="mallory")[0]
    for _ in range(5):
        llm.feedback(hostile.request_id, 1.0, "t9 t9 t9", tenant="mallory")
    probes = tmp_path / "probes.jsonl"
    answer = " ".join(f"t{t}" for t in _probe(llm, [40, 41, 42, 43, 44, 45])[1])
    probes.write_text('{"prompt": "t40 t41 t42 t43 t44 t45", "answer": "%s"}\n' % answer)
    out = runner.invoke(cli_main.app, [*args, "--probes", str(probes)])
    lines = [line for line in out.output.splitlines() if line.strip()]
    assert out.exit_code == 1 and len(lines) == 1 and lines[0].startswith("error: not promoted:"), out.output
    assert os.getpriority(os.PRIO_PROCESS, 0) == max(before, 10)  # two runs: lowered once, not twice
    from ruvllm.witness.log import find, verify

    (entry,) = find(tmp_path / "w.sqlite3", "deep:*")
    assert entry.kind == "promotion" and entry.body["promoted"] is False and entry.body["failed"]
    assert verify(tmp_path / "w.sqlite3").ok


def test_tenants_beyond_the_adapter_capacity_all_learn(base: Path, tmp_path: Path) -> None:
    """Issue 33: once max_cpu_loras tenants had learned, every new tenant's feedback was refused for
    good. Now the least recently served tenants' versions leave the engine and come back from their
    folders when next served, bitwise the same."""
    llm = LLM(str(base), enable_lora=True, max_loras=2, max_cpu_loras=2, max_lora_rank=4, num_blocks=64,
              quantization="none")
    cfg = InstantConfig(layers=1, lr=5e-2, context="full", candidates=0)
    llm.enable_learning(LearningConfig(instant=cfg, root=str(tmp_path / "learned")))
    tenants = [f"t{i}" for i in range(5)]
    after = {}
    for t in tenants:
        asked = llm.generate([PROMPT], GREEDY, tenant=t)[0]
        assert llm.feedback(asked.request_id, 1.0, "t7 t7", tenant=t).version == f"learned:{t}:v1"
        after[t] = _result(llm.generate([PROMPT], GREEDY, tenant=t)[0])
        assert len(llm.loras()) <= 2
    for t in tenants:  # each served again by its own version, loaded again where it was evicted
        assert _result(llm.generate([PROMPT], GREEDY, tenant=t)[0]) == after[t]
        assert f"learned:{t}:v1" in llm.loras()
    stats = llm.stats()
    assert stats.free_blocks == stats.total_blocks
