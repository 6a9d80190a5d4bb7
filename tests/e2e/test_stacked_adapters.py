"""Adapters that stack (issue 37, item 4): a request that names an adapter also carries its tenant's
learned micro-LoRA, both deltas added in one step in a fixed order (the named adapter's, then the
micro-LoRA's).

On the tiny model: the kernel's levels are calls in order; stacked logits are peft's with both
adapters active; a stacked row is bitwise the same alone and batched with every other combination,
in the C++ layer loop and the Python one; feedback on a stacked completion teaches the (tenant,
adapter) pair's micro-LoRA alone; an unload of either adapter waits for the stacked requests.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ruvllm import LLM, SamplingParams
from ruvllm.core.adapters import AdapterRun
from ruvllm.errors import AdapterNotFoundError
from ruvllm.learning.config import InstantConfig, LearningConfig
from ruvllm.learning.learner import stack_scope
from ruvllm.lora.batch import LoraBatch, lora_add_torch, lora_kernel
from ruvllm.messages import CoreRequest
from ruvllm.outputs import ScheduledSeq, SchedulerOutput
from ruvllm.request import Request, scaling_key
from ruvllm.sampling_params import SamplingParams as Params
from tests.engine_fixtures import TINY_GQA, write_tiny_model
from tests.lora_fixtures import hf_model, make_adapter, peft_logits

ATOL = 2e-4  # fp32 logits against peft's, as tests/e2e/test_lora.py
MICRO = ["v_proj", "o_proj", "down_proj"]  # the micro-LoRA's targets (learning/config.py)


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("stacked") / "base")


@pytest.fixture(scope="module")
def adapters(base: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Two named adapters (all seven projections) and two micro-LoRA-shaped ones (rank 2, v/o/down)."""
    root = tmp_path_factory.mktemp("adapters")
    make_adapter(base, root / "a", seed=1, r=8, alpha=16)
    make_adapter(base, root / "b", seed=2, r=4, alpha=8)
    make_adapter(base, root / "m", seed=3, r=2, alpha=4, targets=MICRO)
    make_adapter(base, root / "n", seed=4, r=2, alpha=4, targets=MICRO)
    return {name: root / name for name in "abmn"}


def engine(base: Path, adapters: dict[str, Path], **kw: object) -> LLM:
    # On the CPU wherever a GPU is present too: the C++ layer loop and bitwise batch invariance are
    # the CPU path's (on an H200, session 21, "auto" chose CUDA, whose rows differ in low bits alone
    # and batched, and peft's reference logits are on the CPU).
    llm = LLM(str(base), device="cpu", enable_lora=True, max_loras=kw.pop("max_loras", 6), max_cpu_loras=8,
              max_lora_rank=8, num_blocks=256, max_num_batched_tokens=256, **kw)
    for name, path in adapters.items():
        llm.load_lora(name, path)
    return llm


def stacked_logits(llm: LLM, names: tuple[str, ...], prompt: list[int], continuation: list[int],
                   chunk: int | None) -> torch.Tensor:
    """Teacher-forced logits through the runner with `names` stacked (the first named, the rest on
    it), prefilled in chunks of `chunk`: [1 + len(continuation), V]."""
    kv, runner = llm.core.kv, llm.core.executor.runner
    served = [runner.lora.get(n) for n in names]
    runs = tuple(AdapterRun(n, i, a.num_slots, a.scaling_pass) for i, (n, a) in enumerate(zip(names, served)))
    req = Request("r", list(prompt), Params(), adapter=runs[0], stacked=runs[1:])
    out, pending = [], list(prompt)
    for tok in [None] + continuation:
        if tok is not None:
            req.output_token_ids.append(tok)
            pending = [tok]
        while pending:
            n = len(pending) if chunk is None else min(chunk, len(pending))
            assert kv.allocate_slots(req, n)
            seq = ScheduledSeq("r", pending[:n], req.num_computed_tokens, kv.block_tables("r")[0],
                               sample=n == len(pending), adapter=names[0], stacked=names[1:],
                               scaling_block_table=kv.block_table(scaling_key("r")) if req.scaling_pass else None)
            logits, _ = runner.compute_logits(SchedulerOutput([seq]))
            req.num_computed_tokens += n
            pending = pending[n:]
        out.append(logits[0])
    kv.free(req)
    return torch.stack(out)


def run_core(llm: LLM, requests: list[tuple[str, list[int], str | None, tuple[str, ...]]],
             params: SamplingParams) -> dict[str, tuple[list[int], list]]:
    """Requests (id, prompt, adapter, stacked) added to the core at once and stepped to the end:
    each one's tokens and logprobs."""
    core = llm.core
    for rid, prompt, adapter, stacked in requests:
        core.add_request(CoreRequest(rid, prompt, params, adapter=adapter, stacked=stacked))
    got: dict[str, tuple[list[int], list]] = {rid: ([], []) for rid, *_ in requests}
    while core.has_unfinished:
        for out in core.step():
            got[out.request_id][0].extend(out.new_token_ids)
            got[out.request_id][1].extend(out.new_logprobs or [])
    return got


def assert_kv_free(llm: LLM) -> None:
    stats = llm.stats()
    assert stats.free_blocks == stats.total_blocks


def test_kernel_levels_are_calls_in_order() -> None:
    """row_slot [D, T]: level by level, each as a call of its own, bitwise; the PyTorch path within rounding."""
    from ruvllm.lora.slots import ProjectionSlots

    kernel = lora_kernel()
    if kernel is None:
        pytest.skip("our C++ kernels cannot be built here")
    g = torch.Generator().manual_seed(0)
    S, R, K, bounds = 4, 8, 64, (0, 48, 64, 80)
    p = ProjectionSlots(torch.randn(S, 3 * R, K, generator=g), torch.randn(S, R, bounds[-1], generator=g),
                        torch.randint(1, R + 1, (S, 3), generator=g, dtype=torch.int32), bounds)
    x = torch.randn(29, K, generator=g)
    y0 = torch.randn(29, bounds[-1], generator=g)
    levels = [[t % 5 - 1 for t in range(29)], [(t * 3) % 5 - 1 for t in range(29)]]
    both = y0.clone()
    kernel(both, x, p.A, p.B, p.ranks, torch.tensor(levels, dtype=torch.int32), list(bounds))
    one_by_one = y0.clone()
    for level in levels:
        kernel(one_by_one, x, p.A, p.B, p.ranks, torch.tensor(level, dtype=torch.int32), list(bounds))
    assert torch.equal(both, one_by_one)
    reference = y0.clone()
    for level in levels:
        lora_add_torch(reference, x, p, level)
    assert (both - reference).abs().max() < 1e-4
    assert not torch.equal(both, y0)


def test_stacked_logits_match_peft(base: Path, adapters: dict[str, Path]) -> None:
    """A named adapter with a micro-LoRA stacked on it: peft's logits with both adapters active."""
    from peft import PeftModel

    ref = PeftModel.from_pretrained(hf_model(base), adapters["a"], adapter_name="a")
    ref.load_adapter(adapters["m"], adapter_name="m")
    ref.base_model.set_adapter(["a", "m"])
    ref.eval()
    g = torch.Generator().manual_seed(7)
    prompt = torch.randint(2, TINY_GQA.vocab_size, (37,), generator=g).tolist()
    continuation = torch.randint(2, TINY_GQA.vocab_size, (9,), generator=g).tolist()
    expected = peft_logits(ref, prompt, continuation)
    llm = engine(base, {k: adapters[k] for k in "am"}, dtype="float32")
    alone = {names: stacked_logits(llm, names, prompt, continuation, None) for names in (("a",), ("m",))}
    for names, logits in alone.items():  # the stack is neither adapter alone
        assert (logits - expected).abs().max() > 0.05, names
    for chunk in (None, 5):
        ours = stacked_logits(llm, ("a", "m"), prompt, continuation, chunk)
        diff = (ours - expected).abs().max().item()
        assert diff < ATOL, f"chunk {chunk}: max |logit diff| {diff:.2e}"
        assert torch.equal(ours.argmax(-1), expected.argmax(-1))
    assert_kv_free(llm)


COMBOS: list[tuple[str | None, tuple[str, ...]]] = [
    (None, ()), ("a", ()), ("m", ()), ("a", ("m",)), ("b", ("m",)), ("a", ("n",)), ("b", ()), ("n", ())]


@pytest.mark.parametrize("loop", ["cpp", "python"])
def test_stacked_rows_are_bitwise_alone_and_batched(base: Path, adapters: dict[str, Path], loop: str,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """Every combination (none, named only, micro only, both; two named, two micro) in one batch
    of different lengths: each request's tokens and logprobs are bitwise what it gets alone."""
    from ruvllm.models.cpu_layer_loop import CpuLayerLoop

    llm = engine(base, adapters, dtype="float32")  # fp32: the C++ layer loop runs these steps
    if loop == "python":
        llm.core.executor.runner.model.__dict__["_loop"] = None
    stacked_in_cpp = []
    real_call = CpuLayerLoop.__call__

    def spy(self, x, cos, sin, kv, meta, model, lora=None):  # noqa: ANN001, ANN202
        stacked_in_cpp.append(isinstance(lora, LoraBatch) and bool(lora.stacked))
        return real_call(self, x, cos, sin, kv, meta, model, lora)

    monkeypatch.setattr(CpuLayerLoop, "__call__", spy)
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=3)
    requests = [(f"r{i}", torch.randint(2, 500, (7 + 4 * i,), generator=torch.Generator().manual_seed(30 + i)).tolist(),
                 adapter, stacked) for i, (adapter, stacked) in enumerate(COMBOS)]
    together = run_core(llm, requests, params)
    llm.reset_prefix_cache()
    for rid, prompt, adapter, stacked in requests:
        alone = run_core(llm, [(rid + "-alone", prompt, adapter, stacked)], params)[rid + "-alone"]
        llm.reset_prefix_cache()
        assert together[rid] == alone, (adapter, stacked)
    assert any(stacked_in_cpp) == (loop == "cpp" and lora_kernel() is not None)
    outputs = {(adapter, stacked): together[rid][0] for rid, _, adapter, stacked in requests}
    assert len({tuple(v) for v in outputs.values()}) > 4, "the combinations must differ for the test to mean anything"
    assert_kv_free(llm)


def test_unload_waits_for_stacked_requests(base: Path, adapters: dict[str, Path]) -> None:
    """Unloading the named adapter or the stacked one while stacked requests run: refused to new
    requests at once, the running ones finish on both, then both are freed."""
    llm = engine(base, {k: adapters[k] for k in "amn"})
    core = llm.core
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    core.add_request(CoreRequest("s1", list(range(5, 30)), params, adapter="a", stacked=("m",)))
    core.add_request(CoreRequest("s2", list(range(7, 40)), params, adapter="a", stacked=("n",)))
    counts = {"s1": 0, "s2": 0}
    for out in core.step():
        counts[out.request_id] += len(out.new_token_ids)
    llm.unload_lora("a")
    llm.unload_lora("m")
    assert llm.loras() == ["n"]
    for adapter, stacked in (("a", ()), ("n", ("m",))):
        with pytest.raises(AdapterNotFoundError):
            core.add_request(CoreRequest("late", list(range(5, 30)), params, adapter=adapter, stacked=stacked))
    assert core.executor.lora.names() == ["a", "m", "n"]  # still held
    while core.has_unfinished:
        for out in core.step():
            counts[out.request_id] += len(out.new_token_ids)
    assert counts == {"s1": 16, "s2": 16}
    assert core.executor.lora.names() == ["n"]
    assert core.adapter_registry.names() == ["n"]
    assert_kv_free(llm)


def test_stacks_take_turns_for_slots(base: Path, adapters: dict[str, Path]) -> None:
    """Each adapter of a stack takes a slot: two stacks over 2 slots run one after the other, and a
    stack that needs more slots than the engine has runs its named adapter alone (it could never
    be scheduled otherwise)."""
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    llm = engine(base, adapters, max_loras=2)
    prompt = list(range(5, 25))
    expected = {key: run_core(llm, [(f"x{i}", prompt, *key)], params)[f"x{i}"]
                for i, key in enumerate([("a", ("m",)), ("b", ("n",))])}
    llm.reset_prefix_cache()
    got = run_core(llm, [("p", prompt, "a", ("m",)), ("q", prompt, "b", ("n",))], params)
    assert got["p"] == expected[("a", ("m",))] and got["q"] == expected[("b", ("n",))]
    assert_kv_free(llm)
    one = engine(base, {k: adapters[k] for k in "am"}, max_loras=1)
    named = run_core(one, [("n1", prompt, "a", ())], params)["n1"]
    one.reset_prefix_cache()
    assert run_core(one, [("n2", prompt, "a", ("m",))], params)["n2"] == named
    assert_kv_free(one)


def learning_llm(base: Path, tmp_path: Path, adapters: dict[str, Path]) -> LLM:
    llm = LLM(str(base), enable_lora=True, max_loras=4, max_lora_rank=8, num_blocks=64, quantization="none")
    for name, path in adapters.items():
        llm.load_lora(name, path)
    cfg = InstantConfig(layers=1, lr=5e-2, context="full", candidates=0)
    llm.enable_learning(LearningConfig(instant=cfg, root=str(tmp_path / "learned")))
    return llm


GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=1)
PROMPT = [5, 80, 23, 311, 42, 17, 260, 9, 131, 77]


def _result(out) -> tuple[list[int], list]:  # noqa: ANN001
    c = out.outputs[0]
    return c.token_ids, [{t: lp.logprob for t, lp in d.items()} for d in c.logprobs]


def test_feedback_on_a_stacked_completion_teaches_the_pair_alone(base: Path, adapters: dict[str, Path],
                                                                  tmp_path: Path) -> None:
    """A tenant's request naming adapter `b` carries the tenant's micro-LoRA; feedback on it teaches
    the (tenant, b) micro-LoRA: `b`'s weights, the tenant's own micro-LoRA and other tenants'
    outputs stay bitwise as they were."""
    llm = learning_llm(base, tmp_path, {"b": adapters["b"]})
    weights_b = {k: (a.clone(), b.clone()) for k, (a, b) in llm.core.executor.lora.get("b").weights.items()}
    # the tenant first learns on the base model: its own micro-LoRA, stacked on `b` until the pair has one
    plain = llm.generate([PROMPT], GREEDY, tenant="acme")[0]
    own = llm.feedback(plain.request_id, 1.0, "t9 t9", tenant="acme").version
    assert own == "learned:acme:v1" and llm.learner.adapter_for("acme", "b") == own
    before = {(t, lora): _result(llm.generate([PROMPT], GREEDY, tenant=t, lora=lora)[0])
              for t in ("acme", "globex") for lora in (None, "b")}
    # the stacked request is the core's stack of `b` and the tenant's version, bitwise
    core_stack = run_core(llm, [("direct", PROMPT, "b", (own,))], GREEDY)["direct"]
    assert core_stack[0] == before[("acme", "b")][0]
    assert before[("acme", "b")] != before[("globex", "b")]  # the micro-LoRA moved the stacked output

    asked = llm.generate([PROMPT], GREEDY, tenant="acme", lora="b")[0]
    for _ in range(10):
        result = llm.feedback(asked.request_id, 1.0, "t7 t7 t7 t7", tenant="acme")
    pair = f"learned:{stack_scope('acme', 'b')}:v10"
    assert result.version == pair and llm.learner.adapter_for("acme", "b") == pair
    taught = llm.generate([PROMPT], GREEDY, tenant="acme", lora="b")[0].outputs[0].token_ids
    assert taught[:4] == [7, 7, 7, 7] and before[("acme", "b")][0][:4] != [7, 7, 7, 7]
    # nothing else moved: the tenant on the base, other tenants with and without `b`
    assert llm.learner.adapter_for("acme") == own
    for key in [("acme", None), ("globex", None), ("globex", "b")]:
        assert _result(llm.generate([PROMPT], GREEDY, tenant=key[0], lora=key[1])[0]) == before[key], key
    for k, (a, b) in llm.core.executor.lora.get("b").weights.items():
        assert torch.equal(a, weights_b[k][0]) and torch.equal(b, weights_b[k][1])
    # the pair's version is nobody's to name, and the base-model scope of the tenant is untouched
    from ruvllm.tenants import may_use

    assert not may_use("acme", pair) and not may_use("globex", pair)
    assert [v.version for v in llm.learner.policy.versions("acme")] == [1]
    assert_kv_free(llm)


def test_xlora_with_a_stacked_micro_lora(base: Path, adapters: dict[str, Path], tmp_path: Path) -> None:
    """An X-LoRA model with a micro-LoRA stacked on it: the micro-LoRA's delta comes after the
    mixture in the real pass (the scaling pass stays the base model, so the classifier routes as it
    was trained): peft's logits for that, and the row is bitwise the same alone and batched with
    other combinations."""
    from peft import PeftModel

    from tests.lora_fixtures import make_xlora

    experts = [adapters["a"], adapters["b"]]
    ref = make_xlora(base, tmp_path / "mix", experts, seed=5, xlora_depth=1)
    llm = engine(base, {"mix": tmp_path / "mix", **{k: adapters[k] for k in "amn"}}, dtype="float32")

    # peft's oracle for "the micro-LoRA in the real pass only": the micro-LoRA merged into the base
    # weights under peft's X-LoRA of the same classifier, whose scalings are pinned to those the
    # plain model's scaling pass (the base model) gives
    g = torch.Generator().manual_seed(3)
    prompt, continuation = torch.randint(2, TINY_GQA.vocab_size, (23,), generator=g).tolist(), [7, 99, 12, 5]
    plain = peft_logits(ref, prompt, continuation)
    scalings = ref.get_latest_scalings().clone()
    merged = PeftModel.from_pretrained(hf_model(base), adapters["m"]).merge_and_unload()
    stacked_ref = make_xlora(None, tmp_path / "mix-on-m", experts, seed=5, model=merged, xlora_depth=1)
    classifier = stacked_ref.base_model.internal_xlora_classifier
    classifier.load_state_dict(ref.base_model.internal_xlora_classifier.state_dict())
    classifier.forward = lambda *args, **kwargs: scalings
    expected = peft_logits(stacked_ref, prompt, continuation)
    assert (expected - plain).abs().max() > 0.05, "the micro-LoRA must move the mixture for the test to mean anything"
    for chunk in (None, 6):
        ours = stacked_logits(llm, ("mix", "m"), prompt, continuation, chunk)
        diff = (ours - expected).abs().max().item()
        assert diff < ATOL, f"chunk {chunk}: max |logit diff| {diff:.2e}"
    llm.reset_prefix_cache()  # (stacked_logits' blocks are salted with its own load numbers)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=2)
    combos = [("mix", ("m",)), ("mix", ()), ("a", ("n",)), (None, ()), ("m", ()), ("mix", ("n",))]
    requests = [(f"x{i}", torch.randint(2, 500, (9 + 5 * i,), generator=torch.Generator().manual_seed(50 + i)).tolist(),
                 adapter, stacked) for i, (adapter, stacked) in enumerate(combos)]
    together = run_core(llm, requests, params)
    llm.reset_prefix_cache()
    for rid, prompt, adapter, stacked in requests:
        alone = run_core(llm, [(rid + "-alone", prompt, adapter, stacked)], params)[rid + "-alone"]
        llm.reset_prefix_cache()
        assert together[rid] == alone, (adapter, stacked)
    prompt = requests[0][1]  # the micro-LoRA moves the mixture's output
    plain = run_core(llm, [("plain", prompt, "mix", ())], params)["plain"]
    assert plain[1] != together["x0"][1]
    assert_kv_free(llm)


def test_stacking_through_the_server(base: Path, adapters: dict[str, Path], tmp_path: Path) -> None:
    """Through the `openai` client: a keyed tenant's `model: "b"` carries its micro-LoRA for `b`,
    taught by /v1/feedback on a `b` completion (the answer names the pair's version), another
    tenant's `b` outputs stay bitwise the same, the pair's version is listed to nobody, and the
    witness log records the stack."""
    import httpx
    import openai

    from ruvllm.server.tenants import read_api_keys
    from ruvllm.witness.log import find
    from tests.server.conftest import start_server

    (tmp_path / "keys").write_text("key-a acme\nkey-b globex\n")
    llm = LLM(str(base), enable_lora=True, max_loras=4, max_lora_rank=8, quantization="none")
    learning = LearningConfig(instant=InstantConfig(layers=1, lr=5e-2, context="full", candidates=0),
                              root=str(tmp_path / "learned"))
    for server in start_server(llm, api_keys=read_api_keys(tmp_path / "keys"), learning=learning,
                               feedback_burst=20, witness_log=str(tmp_path / "w.sqlite3")):
        server.engine.load_lora("b", str(adapters["b"]))

        def complete(key: str, model: str = "b") -> tuple[str, list[str], list[float]]:
            client = openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0)
            out = client.completions.create(model=model, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=1,
                                            extra_body={"ignore_eos": True})
            return out.id, out.choices[0].logprobs.tokens, out.choices[0].logprobs.token_logprobs

        other_before = complete("key-b")[1:]
        rid, tokens, _ = complete("key-a")
        for _ in range(10):
            r = httpx.post(server.url + "/v1/feedback", json={"id": rid, "score": 1.0, "correction": "t7 t7 t7 t7"},
                           headers={"Authorization": "Bearer key-a"}, timeout=60)
            assert r.status_code == 200, r.text
        pair = f"learned:{stack_scope('acme', 'b')}:v10"
        assert r.json()["adapter"] == pair
        taught = complete("key-a")
        assert taught[1][:4] == ["t7"] * 4 and tokens[:4] != taught[1][:4]
        assert complete("key-b")[1:] == other_before  # bitwise: tokens and logprobs
        for key in ("key-a", "key-b"):
            listed = openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0).models.list()
            assert pair not in [m.id for m in listed.data] and "b" in [m.id for m in listed.data]
        server.app.state.ruvllm.service.witness.flush()
        entry = next(e for e in find(Path(server.cfg.witness_log), taught[0]) if e.kind == "completion")
        assert entry.body["adapter"] == "b" and entry.body["stacked"] == [pair]
