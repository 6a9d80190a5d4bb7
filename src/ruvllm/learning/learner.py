"""Feedback to served adapters: each tenant's micro-LoRA takes an instant gradient step per feedback
event, and the result is served at once as the tenant's next adapter version.

A version is a PEFT folder (`<root>/<tenant>/v<N>/`, so peft loads it too) loaded into the engine
as adapter `learned:<tenant>:v<N>`; the tenant's requests that name no adapter run with its newest
version; the one before the previous is unloaded (requests still running on it finish on it). Other
tenants never see it: their requests run without it, and each tenant's prefix cache is salted.
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

import torch

from ruvllm.errors import AdapterCapacityError, AdapterError
from ruvllm.learning.config import LearningConfig
from ruvllm.learning.errors import CompletionNotFoundError, FeedbackError, UpdateNotServedError
from ruvllm.learning.anchor import BaseAnchor, KlTerm, kl_grads, kl_mean, make_anchor
from ruvllm.learning.instant import AheadTerm, InstantLearner, Prepared, TenantState, feedback_loss
from ruvllm.learning.background import BackgroundLoop
from ruvllm.learning.bank import PatternBank, PromptEmbedder
from ruvllm.learning.deep import GLOBAL, DeepConfig, DeepResult, train_and_check
from ruvllm.learning.tail import MicroLora
from ruvllm.tenants import LEARNED_PREFIX

if TYPE_CHECKING:
    from ruvllm.sampling_params import SamplingParams
    from ruvllm.witness.log import WitnessLog
from ruvllm.learning.policy import PolicyStore
from ruvllm.learning.store import Completion, CompletionStore


class AdapterHost(Protocol):
    """What the learner needs of an engine (LLM and AsyncEngine both have it)."""

    def load_lora(self, name: str, path: str | Path) -> None: ...

    def unload_lora(self, name: str) -> None: ...

    def write(self, prompts: list[list[int]], params: SamplingParams) -> list[list[str]]:
        """The base model's texts for `prompts` (params.n each): no tenant's adapter, not kept for
        feedback (the question forms' writer, learning/rewrites.py)."""
        ...


@dataclass(frozen=True)
class FeedbackResult:
    tenant: str
    version: str  # the adapter now serving the tenant
    loss: float
    prepare_ms: float  # hidden states below the learned layers (0 when kept from an earlier event)
    step_ms: float  # the gradient step (forward, backward, optimizer)
    publish_ms: float  # writing the version and loading it into the engine
    events: int = 1  # the events learned in the same step (a backlog coalesced: server/backlog.py)


class FeedbackEvent(NamedTuple):
    """One feedback event as the API takes it (Learner.feedback's arguments)."""

    completion_id: str
    tenant: str
    score: float
    correction: str | None = None


@dataclass(frozen=True)
class _Checked:
    """An event found valid: what its update learns, and whose micro-LoRA (the scope)."""

    completion_id: str
    tenant: str
    scope: str
    prompt_ids: list[int]
    target: list[int]
    score: float


class Learner:
    def __init__(self, model_path: str | None, host: AdapterHost, tokenizer: Any, eos_token_id: int,
                 config: LearningConfig | None = None, witness: WitnessLog | None = None) -> None:
        from ruvllm.learning.tail import LearnedLayers, hidden_before, load_learning_model
        from ruvllm.loader import resolve_model

        self.config = config or LearningConfig()
        if self.config.threads is not None:
            torch.set_num_threads(self.config.threads)
        self.host, self.tokenizer, self.eos = host, tokenizer, eos_token_id
        self.witness = witness  # promotions and refusals are witnessed there too
        src = resolve_model(model_path)
        model, self.model_config = load_learning_model(src)  # packed weights stay packed (learning/tail.py)
        self.layers = LearnedLayers(model, min(self.config.instant.layers, self.model_config.num_layers),
                                    self.config.instant.backward)
        first = self.layers.first
        self.instant = InstantLearner(self.layers, self.config.instant,
                                      PromptEmbedder.for_model(tokenizer, lambda ids: hidden_before(model, ids, first)))
        self.store = CompletionStore(self.config.store_count, self.config.store_age_s)
        self.root = Path(self.config.root or default_learned_dir()).expanduser()
        self.policy = PolicyStore(self.root / "policy.sqlite3")
        self.bank = PatternBank(self.root / "bank.sqlite3")
        # Learning state (micro-LoRA, Adam moments, Fisher) of the `states_keep` most recently taught
        # scopes, least recent first; any other is rebuilt from its serving version when it next
        # learns (_state): memory does not grow with the tenants that ever learned (issue 33).
        self._tenants: OrderedDict[str, TenantState] = OrderedDict()
        self._busy: set[str] = set()  # scopes a consolidation pass is working on: never evicted meanwhile
        self._versions: dict[str, int] = {}  # the version serving each tenant
        # Versions loaded in the engine, per tenant, oldest first; tenants least recently served
        # first. When the engine holds all it keeps (max_cpu_loras), the least recently served
        # tenants' versions are unloaded, and loaded again from their folders when next served: no
        # tenant is refused because others learned. Its own lock: serving never waits for an update.
        self._loaded: OrderedDict[str, list[int]] = OrderedDict()
        self._loads = threading.RLock()
        self._prepared: OrderedDict[tuple, Prepared] = OrderedDict()  # at most prepared_keep, least recent first
        self._anchors: OrderedDict[tuple, BaseAnchor] = OrderedDict()  # the KL term's, bounded alike
        self._rewritten: OrderedDict[tuple, list[str]] = OrderedDict()  # question_forms' rewrites, bounded alike
        self._pending: dict[str, int] = {}  # feedback events learned since each tenant's last consolidation
        self._kl_gen = torch.Generator().manual_seed(self.config.instant.seed + 1)  # the KL term's drawn tokens
        # (and those of the term computed ahead, on the background thread: a generator of its own)
        self._ahead_gen = torch.Generator().manual_seed(self.config.instant.seed + 2)
        # Who is about the KL term computed ahead (_ahead), under a lock of its own (never held while
        # computing): the scopes whose term is being computed, set when done, and the steps of each
        # scope waiting or running. A step waits for a term in progress rather than compute it again;
        # a term is not begun for a scope whose step is already coming (a backlog), which would find
        # the weights changed and throw it away: no CPU is spent twice.
        self._ahead_lock = threading.Lock()
        self._ahead_busy: dict[str, threading.Event] = {}
        self._stepping: dict[str, int] = {}
        # Each scope's updates that a backlog (feedback_many) has queued and not yet begun: the
        # background pass does not publish a scope whose update is coming, whose version will serve
        # the pass's pull too (session 23: under a backlog the pass's publish, an engine round trip
        # of ~340 ms beside 32 streams, held the lock every update waits for).
        self._coming: dict[str, int] = {}
        self._lock = threading.Lock()  # one update at a time; the server asks from worker threads, never its event loop
        with self._lock:
            self._sync()  # what served each tenant before a restart serves it again
        self.instant.fill_candidates()  # the first step's drawn candidates; the background pass makes the rest
        self._background = (BackgroundLoop(self.consolidate, self.config.background_s, self.config.nice)
                            if self.config.background_s is not None else None)

    def close(self) -> None:
        """Stop the background loop (after the pass in progress) and close the stores."""
        if self._background is not None:
            self._background.close()
        self.policy.close()
        self.bank.close()

    # --- serving side ------------------------------------------------------------------------------
    def remember(self, completion_id: str, tenant: str, prompt_ids: list[int], output_ids: list[int],
                 adapter: str | None) -> None:
        self.store.add(completion_id, Completion(tenant, list(prompt_ids), list(output_ids), adapter, time.time()))

    def adapter_for(self, tenant: str, adapter: str | None = None) -> str | None:
        """The adapter serving the tenant: its own newest version (or what the policy store was told
        since), else the version promoted for everyone, else None: the base model. With `adapter`
        (one the request names), the micro-LoRA stacked on it: the (tenant, adapter) pair's own
        version, else what would serve the tenant on the base model."""
        if self.policy.changed_elsewhere():  # `ruvllm learn rollback / reset / run` on a running server
            with self._lock:
                self._sync()
        scopes = (tenant, GLOBAL) if adapter is None else (stack_scope(tenant, adapter), tenant, GLOBAL)
        for scope in scopes:
            n = self._versions.get(scope)
            if n is not None:
                with self._loads:
                    if n not in self._loaded.get(scope, ()):  # evicted: loaded again from its folder
                        row = self.policy.version(scope, n)
                        if row is None:
                            return None
                        self._load(scope, n, row.path)
                    self._loaded.move_to_end(scope)
                return _name(scope, n)
        return None

    def _load(self, tenant: str, version: int, path: str | Path) -> None:
        """Load a version into the engine, unloading the least recently served other tenants'
        versions while the engine holds all it keeps."""
        with self._loads:
            while True:
                try:
                    self.host.load_lora(_name(tenant, version), path)
                    break
                except AdapterCapacityError:
                    victim = next((t for t, loaded in self._loaded.items() if t != tenant and loaded), None)
                    if victim is None:
                        raise
                    for v in self._loaded.pop(victim):
                        self.host.unload_lora(_name(victim, v))
            self._loaded.setdefault(tenant, []).append(version)
            self._loaded.move_to_end(tenant)

    # --- the deep loop -----------------------------------------------------------------------------
    def deep_run(self, scope: str, heldout: list[int], probes: list[tuple[list[int], list[int]]],
                 config: DeepConfig | None = None, general: list[int] | None = None) -> DeepResult:
        """Fine-tune over the bank's best example per cluster (the tenant's, or with GLOBAL every
        tenant's), check, and promote a new version for the scope only if every check passes."""
        c = self.config.instant
        config = config or DeepConfig(rank=c.rank, alpha=c.alpha, layers=self.layers.cfg.num_layers - self.layers.first,
                                      targets=c.targets)
        tenants = self.bank.tenants() if scope == GLOBAL else [scope]
        examples = [(e.prompt_ids, e.target_ids) for t in tenants for e in self.bank.best_per_cluster(t)
                    if e.score > 0]
        if not examples:
            raise ValueError(f"the pattern bank has no positive example for {scope!r} to train on")
        with self._lock:
            current = self._state(scope) if scope in self._versions else None
            start = current.lora if current is not None and current.lora.rank == config.rank else None
            result, lora = train_and_check(self.layers, examples, heldout, probes, config, scope, start, general)
            version = None
            if result.passed:
                version = self._publish(scope, lora, "deep", dict(result.checks))
            else:
                self.policy.note(scope, "refused", {"failed": result.failed, **result.checks})
        if self.witness is not None:
            self.witness.append(f"deep:{scope}", "promotion", scope, {
                "promoted": result.passed, "adapter_version": version, "examples": result.examples,
                "checks": result.checks, "failed": result.failed})
        return result

    def _sync(self) -> None:
        """Serve what the policy store says serves each tenant."""
        serving = self.policy.serving()
        for tenant in set(serving) | set(self._versions):
            want = serving.get(tenant)
            if want != self._versions.get(tenant):
                self._switch(tenant, want)

    def _switch(self, tenant: str, version: int | None) -> None:
        """Serve `version` (None: the base model) to the tenant; its learning continues from it (the
        state is rebuilt from it when the tenant next learns: _state)."""
        self._tenants.pop(tenant, None)
        if version is None:
            self._versions.pop(tenant, None)
            self._trim(tenant, keep=0)
            return
        row = self.policy.version(tenant, version)
        if row is None:
            return
        if version not in self._loaded.get(tenant, ()):
            self._load(tenant, version, row.path)
        self._versions[tenant] = version
        self._trim(tenant, keep=2)

    def _state(self, scope: str) -> TenantState:
        """The scope's learning state, most recently used now: kept, or rebuilt from the version
        serving it (a pair without one: from what its tenant learned on the base, which served the
        pair till now), else fresh; then the least recently used states beyond `states_keep` go
        (those with updates waiting for consolidation last). A rebuilt state has the served weights and
        step count, fresh Adam moments and no Fisher yet (drawn at its next consolidation)."""
        state = self._tenants.get(scope)
        if state is None:
            state = self._tenants[scope] = self._rebuild(scope)
        self._tenants.move_to_end(scope)
        spare = len(self._tenants) - self.config.states_keep
        if spare > 0:
            # those with updates waiting for the background pass go last (their pulls go with them: the
            # version they serve stays as the steps left it; offline, without consolidate(), all wait);
            # never one a pass is working on
            order = sorted((t for t in self._tenants if t != scope and t not in self._busy),
                           key=lambda t: t in self._pending)
            for victim in order[:spare]:
                del self._tenants[victim]
                self._pending.pop(victim, None)
        return state

    def _rebuild(self, scope: str) -> TenantState:
        from safetensors.torch import load_file

        pair = _pair(scope)
        source = scope if scope in self._versions else pair[0] if pair is not None else None
        row = self.policy.version(source, self._versions[source]) \
            if source is not None and source in self._versions else None
        if row is not None:
            try:
                state = self.instant.new_tenant(_seed(scope), load_file(str(Path(row.path) / "adapter_model.safetensors")))
                if source == scope:
                    state.steps = int(row.checks.get("steps", 0))
                return state
            except (KeyError, RuntimeError, OSError):
                pass  # made with other learned layers, targets or rank: served as it is, learning starts afresh
        return self.instant.new_tenant(seed=_seed(scope))

    def _keep_prepared(self, key: tuple, prep: Prepared) -> None:
        """Keep a prepared pair for later events on it, the least recently used beyond the bound dropped."""
        self._prepared[key] = prep
        self._prepared.move_to_end(key)
        while len(self._prepared) > self.config.prepared_keep:
            self._prepared.popitem(last=False)

    def _trim(self, tenant: str, keep: int) -> None:
        """Unload all but the tenant's `keep` most recently loaded versions (the serving one stays):
        a request routed to the one before still finds it; running requests finish on theirs."""
        with self._loads:
            loaded = self._loaded.get(tenant, [])
            serving = self._versions.get(tenant)
            while len(loaded) > keep:
                victim = next((v for v in loaded if v != serving), None)
                if victim is None:
                    break
                loaded.remove(victim)
                self.host.unload_lora(_name(tenant, victim))

    # --- feedback ----------------------------------------------------------------------------------
    def feedback(self, completion_id: str, tenant: str, score: float, correction: str | None = None) -> FeedbackResult:
        """Learn one feedback event at once: one step (`InstantLearner.step`), served as the scope's next version."""
        return self._learn([self._check(FeedbackEvent(completion_id, tenant, score, correction))])[0]

    def feedback_many(self, events: list[FeedbackEvent]) -> Iterator[tuple[int, FeedbackResult | Exception]]:
        """Learn a backlog of events (issue 37 item 3), yielding (index in `events`, its result or the
        error that refused it) as each is done. Each scope's events, in the order given, are learned in
        steps of up to `update_batch` (one `step_events`, one version served), scopes in turn: a
        tenant's events are never reordered, and one tenant's long backlog does not hold another's
        back for more than a step. A lone event of a scope takes `feedback`'s own path (`step`).
        Every event keeps its own result: its loss, the version its step made, the step's times."""
        queues: OrderedDict[str, list[tuple[int, _Checked]]] = OrderedDict()
        for i, event in enumerate(events):
            try:
                checked = self._check(event)
            except Exception as exc:  # noqa: BLE001  # refused: that event's answer alone
                yield i, exc
                continue
            queues.setdefault(checked.scope, []).append((i, checked))
        # (with more steps an event until its own target is reached, which has no batched form: one at a time)
        size = self.config.update_batch if self.config.instant.steps_per_event == 1 else 1

        def expect(sign: int) -> None:  # each scope's updates still queued, counted as coming (or no more)
            with self._ahead_lock:
                for scope, q in queues.items():
                    self._count_coming(scope, sign * -(-len(q) // size))
        expect(1)
        try:
            while queues:
                for scope in list(queues):
                    chunk, queues[scope] = queues[scope][:size], queues[scope][size:]
                    if not queues[scope]:
                        del queues[scope]
                    try:
                        results: list[FeedbackResult | Exception] = list(self._learn([c for _, c in chunk],
                                                                                     queued=True))
                    except Exception as exc:  # noqa: BLE001  # the step failed: every event in it gets the error
                        results = [exc] * len(chunk)
                    yield from ((i, r) for (i, _), r in zip(chunk, results))
        finally:  # (also when the caller stops taking results: what was not begun is no longer coming)
            expect(-1)

    def _count_coming(self, scope: str, n: int) -> None:
        """Add n to the scope's updates coming (under `_ahead_lock`)."""
        self._coming[scope] = self._coming.get(scope, 0) + n
        if not self._coming[scope]:
            del self._coming[scope]

    def _check(self, event: FeedbackEvent) -> _Checked:
        """The event's completion, target, score and scope, or the error (typed) that refuses it."""
        completion_id, tenant, score, correction = event
        if not isinstance(score, (int, float)) or isinstance(score, bool) or not -1.0 <= score <= 1.0:
            raise FeedbackError(f"score must be a number from -1 to 1, got {score!r}", "score")
        if correction is not None and not correction.strip():
            raise FeedbackError("correction is empty", "correction")
        if correction is not None and not correction.isascii():
            try:
                correction.encode("utf-8")
            except UnicodeEncodeError:
                raise FeedbackError("correction is not valid text (it holds a lone surrogate)", "correction") from None
        done = self.store.get(completion_id, tenant)
        if done is None:
            raise CompletionNotFoundError(f"no completion {completion_id!r} to give feedback on (unknown or expired)", "id")
        if correction is not None:
            limit = self.config.feedback_max_tokens
            if len(correction) > 64 * limit:  # no tokenizer makes that few tokens of it: spare the encode
                raise FeedbackError(f"correction is {len(correction):,} characters, over the bound of {limit} "
                                    "tokens (--feedback-max-tokens)", "correction")
            target = self.tokenizer.encode(correction, add_special_tokens=False) + [self.eos]
            if len(target) > limit:
                raise FeedbackError(f"correction is {len(target)} tokens, over the bound of {limit} "
                                    "(--feedback-max-tokens)", "correction")
            room = self.model_config.max_position_embeddings - len(done.prompt_ids)
            if len(target) > room:
                raise FeedbackError(f"the prompt and the correction are {len(done.prompt_ids) + len(target)} "
                                    "tokens, more than the model's context", "correction")
            score = abs(score) if score else 1.0  # a correction is always learned toward
        else:
            target = done.output_ids
            if not target:
                raise FeedbackError("the completion has no output tokens to learn from", "id")
            if score == 0:
                raise FeedbackError("a score of 0 without a correction teaches nothing", "score")
        # Feedback on a completion of a named adapter teaches the (tenant, adapter) pair's micro-LoRA,
        # stacked on that adapter when served; never the adapter itself, nor the tenant's own.
        scope = tenant if done.adapter is None or done.adapter.startswith(LEARNED_PREFIX) \
            else stack_scope(tenant, done.adapter)
        return _Checked(completion_id, tenant, scope, done.prompt_ids, target, score)

    def _learn(self, chunk: list[_Checked], queued: bool = False) -> list[FeedbackResult]:
        """One update of a scope over its events (all of one scope, in order): one `step` for a lone
        event, else one `step_events` over them all; one version published. The background loop's
        pull counts events, as when every event was a step (its pull per event does not depend on
        how the events were coalesced); its Fisher's refresh counts updates (the weights move once
        an update). `queued`: an update feedback_many counted as coming (`_coming`)."""
        scope, tenant = chunk[0].scope, chunk[0].tenant
        with self._ahead_lock:
            self._stepping[scope] = self._stepping.get(scope, 0) + 1
            if queued:  # an update feedback_many counted as coming: begun now
                self._count_coming(scope, -1)
            busy = self._ahead_busy.get(scope)
        try:
            if busy is not None:
                busy.wait()  # its term, at the weights this step starts from, is nearly done
            return self._learn_locked(chunk, scope, tenant)
        except Exception:
            # A pull the background pass left to this update's version (consolidate) is served by
            # the next pass instead (a pass of no events pulls nothing more).
            with self._lock:
                self._pending.setdefault(scope, 0)
            if self._background is not None:
                self._background.notify()
            raise
        finally:
            with self._ahead_lock:
                self._stepping[scope] -= 1
                if not self._stepping[scope]:
                    del self._stepping[scope]

    def _learn_locked(self, chunk: list[_Checked], scope: str, tenant: str) -> list[FeedbackResult]:
        with self._lock:
            preps = []
            t = time.perf_counter()
            for event in chunk:
                key = (self.config.instant.context, tuple(event.prompt_ids), tuple(event.target))
                prep = self._prepared.get(key)
                if prep is None:
                    prep = self.instant.prepare(event.prompt_ids, event.target)
                self._keep_prepared(key, prep)
                self.store.mark_taught(event.completion_id)  # what it taught is not its everyday text (Fisher, KL)
                preps.append(prep)
            anchors = self._anchors_of(scope) if self.config.instant.kl_weight > 0 else []
            forms = [self._forms(e.prompt_ids, e.target) if e.score > 0 else [] for e in chunk]
            prepare_ms = (time.perf_counter() - t) * 1000
            state = self._state(scope)
            # The KL term's gradients computed ahead at exactly these weights (after the scope's last
            # change: _ahead), else computed here in the step as before: the same gradient either way.
            ready, state.ahead = state.ahead, None
            ahead = ready.grads if ready is not None and anchors and ready.fits(state.lora, tuple(anchors)) \
                and self.config.instant.steps_per_event == 1 else None
            kl = [] if ahead is not None else anchors
            if len(chunk) == 1:
                timing = self.instant.step(state, preps[0], chunk[0].score,
                                           self._extra(kl, [(forms[0], chunk[0].score)]), ahead)
                losses = [timing.loss]
            else:
                timing = self.instant.step_events(state, [(p, e.score) for p, e in zip(preps, chunk)],
                                                  self._extra(kl, [(f, e.score) for f, e in zip(forms, chunk)]),
                                                  ahead)
                losses = timing.losses or []
            for event, prep in zip(chunk, preps):
                if prep.embedding is not None:
                    self.bank.add(tenant, event.prompt_ids, event.target, event.score, prep.embedding.numpy())
            t = time.perf_counter()
            checks: dict[str, Any] = {"loss": timing.loss, "steps": state.steps}
            if len(chunk) > 1:
                checks["events"] = len(chunk)
            try:
                version = self._publish(scope, state.lora, "instant", checks)
            except AdapterError as exc:  # the engine keeps no more adapters (max_cpu_loras)
                raise UpdateNotServedError(f"the update could not be served: {exc}") from exc
            publish_ms = (time.perf_counter() - t) * 1000
            self._pending[scope] = self._pending.get(scope, 0) + len(chunk)
            state.since_fisher += 1
        if self._background is not None:
            self._background.notify()
        step_ms = (timing.forward_backward + timing.optimizer) * 1000
        return [FeedbackResult(tenant, version, loss, prepare_ms, step_ms, publish_ms, len(chunk)) for loss in losses]

    # --- the background loop ------------------------------------------------------------------------
    def consolidate(self) -> dict[str, str]:
        """Consolidate each tenant's instant updates since the last call under EWC++: refresh its
        Fisher when `fisher_every` updates have passed (or it has none yet), pull its micro-LoRA
        toward the base once per feedback event, and serve the result as a new version, unless an
        update of the tenant is coming (a backlog's, or one waiting for the lock), whose version
        serves the pulled weights. Returns {tenant: version} for those published (a tenant without
        completions of its own has no Fisher yet: unchanged).

        The Fisher's forward and backward passes (and preparing its completions, 1.5 s the first
        time) run without the learner's lock, on a copy of the micro-LoRA taken under it, so a
        feedback request never waits for them; only the pull and the publish hold the lock."""
        c = self.config.instant
        if c.ewc_lambda <= 0:
            with self._lock:
                pending, self._pending = self._pending, {}
            self.instant.fill_candidates()  # the next steps' drawn candidates (candidates.py)
            for scope in pending:
                self._ahead(scope)
            return {}
        with self._lock:
            pending, self._pending = self._pending, {}
            jobs = []  # (tenant, its state, events, a copy to draw the Fisher at, or None)
            for tenant, events in pending.items():
                state = self._tenants.get(tenant)
                if state is None:
                    continue
                # The Fisher is the curvature at the weights, which move once an update: a backlog's
                # update over several events refreshes it as often as one update an event would
                # (docs/learning.md, session 23: refreshed by events it was 30% of the learner's CPU
                # under a backlog). The pull stays once per event.
                refresh = state.fisher is None or state.since_fisher >= c.fisher_every
                if refresh:
                    state.since_fisher = 0
                copy = self.instant.new_tenant(_seed(tenant), state.lora.peft_tensors()).lora if refresh else None
                jobs.append((tenant, state, events, copy))
            self._busy = {tenant for tenant, *_ in jobs}
        draws = {}
        for tenant, _, _, copy in jobs:
            if copy is not None:
                t = time.perf_counter()
                samples = self._fisher_samples(tenant)
                if samples:
                    draws[tenant] = (self.instant.fisher_sample(copy, samples), time.perf_counter() - t)
        # The next steps' drawn candidates (a few ms, under the pool's own lock, never the learner's):
        # after the Fisher's draws, which take theirs from the same pool in turn (as they drew from
        # the steps' generator before), and before the pull waits for the lock, so that a step coming
        # while the pass is still busy finds them ready.
        self.instant.fill_candidates()
        published = {}
        with self._lock:
            self._busy = set()
            for tenant, state, events, _ in jobs:
                if self._tenants.get(tenant) is not state:  # switched (a rollback, a reset) meanwhile
                    continue
                sq, fisher_s = draws.get(tenant, (None, 0.0))
                if sq is not None:
                    self.instant.fold_fisher(state, sq)
                if state.fisher is None:
                    continue
                kept = self.instant.consolidate(state, events)
                with self._ahead_lock:
                    coming = tenant in self._coming or tenant in self._stepping
                if coming:  # the update coming serves the pulled weights (its version's weights)
                    continue
                published[tenant] = self._publish(tenant, state.lora, "background", {
                    "kept": kept, "steps": state.steps, "fisher_ms": fisher_s * 1000})
        for tenant, *_ in jobs:
            self._ahead(tenant)
        return published

    def _ahead(self, scope: str) -> None:
        """Compute the KL term's gradients for the scope's next step now, off the feedback's path (the
        background loop's thread, after its pull): the term depends only on the micro-LoRA's weights
        and the tenant's everyday completions, so the next step, if it starts from these weights on
        these completions (AheadTerm.fits), adds them instead of running the term itself, and an
        update waits for its own event's forward and backward alone (docs/learning.md, issue 37
        item 1). Like the Fisher's draw, it runs on a copy without the learner's lock; a step of the
        scope that arrives meanwhile waits for it (_learn), and none is begun for a scope whose step
        is already waiting or running. A step that finds the weights changed since (a rollback, a
        deep promotion) computes the term itself."""
        c = self.config.instant
        if c.kl_weight <= 0 or c.steps_per_event != 1:
            return
        with self._ahead_lock:
            if self._stepping.get(scope):
                return  # a step of the scope is coming (a backlog): it computes the term itself
            done = self._ahead_busy[scope] = threading.Event()
        try:
            with self._lock:
                state = self._tenants.get(scope)
                if state is None:
                    return
                anchors = self._anchors_of(scope)
                if not anchors:
                    return
                copy = state.lora.copy()
            at = [p.detach().clone() for p in copy.parameters()]
            term = KlTerm(self.layers, anchors, c.kl_weight, c.candidates, self._ahead_gen, kl_mean)
            # the completions through the learned layers' C++ calls, no graph (session 21), where
            # they apply; else autograd's graph of the term
            by_hand = kl_grads(self.layers, copy, term) if self.instant._kl_term(term) is not None else None
            if by_hand is not None:
                grads = by_hand[1]
            else:
                grads = torch.autograd.grad(term(copy), copy.parameters(), allow_unused=True)
                grads = [torch.zeros_like(p) if g is None else g for p, g in zip(copy.parameters(), grads)]
            with self._lock:
                if self._tenants.get(scope) is state:
                    state.ahead = AheadTerm(at, tuple(anchors), grads)
        finally:
            with self._ahead_lock:
                del self._ahead_busy[scope]
            done.set()

    def _everyday(self, scope: str, n: int) -> list[Completion]:
        """The scope's own n most recent completions, none it gave feedback on (what it taught is not
        its everyday traffic; another tenant's text never counts). A (tenant, adapter) pair's: the
        tenant's completions of that adapter."""
        pair = _pair(scope)
        if pair is None:
            return self.store.recent(scope, n)
        return [c for c in self.store.recent(pair[0], self.store.max_count) if c.adapter == pair[1]][:n]

    def _fisher_samples(self, tenant: str) -> list[Prepared]:
        """The tenant's everyday completions, prepared; the shared cache is only touched under the lock."""
        samples = []
        for done in self._everyday(tenant, self.config.instant.fisher_samples):
            key = ("full", tuple(done.prompt_ids), tuple(done.output_ids))
            with self._lock:
                prep = self._prepared.get(key)
            if prep is None:
                prep = self.instant.prepare(done.prompt_ids, done.output_ids, "full")
            with self._lock:
                self._keep_prepared(key, prep)
            samples.append(prep)
        return samples

    def _anchors_of(self, scope: str) -> list[BaseAnchor]:
        """The KL term's everyday completions with the base's distributions (under the lock; made
        once per completion, the least recently used beyond `prepared_keep` dropped)."""
        c = self.config.instant
        anchors = []
        for done in self._everyday(scope, c.kl_samples):
            key = (tuple(done.prompt_ids), tuple(done.output_ids))
            anchor = self._anchors.get(key)
            if anchor is None:
                prep = self.instant.prepare(done.prompt_ids, done.output_ids, "full")
                anchor = make_anchor(self.layers, prep, c.kl_top)
            self._anchors[key] = anchor
            self._anchors.move_to_end(key)
            anchors.append(anchor)
        while len(self._anchors) > self.config.prepared_keep:
            self._anchors.popitem(last=False)
        return anchors

    def _forms(self, prompt_ids: list[int], target: list[int]) -> list[Prepared]:
        """The correction's other forms to learn it under (under the lock): the prompt's user message
        under `system_prompt`, and rewrites of it the model writes (`question_forms`), prepared (kept
        as any pair is)."""
        from ruvllm.engine.prompts import render_chat

        c = self.config.instant
        forms = [] if not c.system_prompt else [under_system(self.tokenizer, prompt_ids, c.system_prompt)]
        forms += [render_chat(self.tokenizer, [{"role": "user", "content": text}])
                  for text in self.question_forms(prompt_ids)]
        preps = []
        for form in forms:
            if form is None or len(form) + len(target) > self.model_config.max_position_embeddings:
                continue
            key = (c.context, tuple(form), tuple(target))
            prep = self._prepared.get(key) or self.instant.prepare(form, target)
            self._keep_prepared(key, prep)
            preps.append(prep)
        return preps

    def question_forms(self, prompt_ids: list[int]) -> list[str]:
        """Up to `question_forms` rewrites of the prompt's one user message, written by the served base
        model (the host's `write`: the greedy one, then 2n samples at T=0.8, seeded) and filtered
        (learning/rewrites.py); written once per prompt, kept as the prepared pairs are. [] when off,
        or for a prompt that is not one user turn of the chat template. `_forms` calls it under the
        learner's lock (an engine request of ~2n short samples, once per question)."""
        from ruvllm.engine.prompts import render_chat
        from ruvllm.learning.rewrites import SHOTS, kept_rewrites, names
        from ruvllm.learning.tail import hidden_before
        from ruvllm.sampling_params import SamplingParams

        n = self.config.instant.question_forms
        question = user_message(self.tokenizer, prompt_ids) if n else None
        if question is None:
            return []
        key = tuple(prompt_ids)
        if key not in self._rewritten:
            ask = [list(self.tokenizer.encode(SHOTS.format(question=question)))]
            # the greedy rewrite first (the closest, measured), then samples for more forms
            texts = self.host.write(ask, SamplingParams(temperature=0, max_tokens=32, stop=["\n"]))[0] + \
                self.host.write(ask, SamplingParams(n=2 * n, temperature=0.8, max_tokens=32, stop=["\n"],
                                                    seed=self.config.instant.seed))[0]
            first = self.layers.first

            def embed(text: str) -> torch.Tensor:  # the bank's embedding of the text as the user's message
                ids = render_chat(self.tokenizer, [{"role": "user", "content": text}])
                return self.instant.embedder(hidden_before(self.layers.model, ids, first), ids)

            self._rewritten[key] = kept_rewrites(question, texts, n, names(question, self.tokenizer), embed)
        self._rewritten.move_to_end(key)
        while len(self._rewritten) > self.config.prepared_keep:
            self._rewritten.popitem(last=False)
        return self._rewritten[key]

    def _extra(self, anchors: list[BaseAnchor], events: list[tuple[list[Prepared], float]]):
        """The step's extra terms, or None: kl_weight times the mean KL toward the base over
        `anchors`, and the feedback's loss under each event's other forms (with their event's score),
        over the events' count (the mean of the events' losses, as `step_events` takes it; the same
        for one event: `step`'s loss is then the sum over its forms)."""
        c = self.config.instant
        if not anchors and not any(forms for forms, _ in events):
            return None
        if not any(forms for forms, _ in events):  # the KL term alone: a graphless step can run it (instant.py)
            return KlTerm(self.layers, anchors, c.kl_weight, c.candidates, self._kl_gen, kl_mean)

        def term(lora: MicroLora):
            total = 0.0
            if anchors:
                total = c.kl_weight * kl_mean(self.layers, lora, anchors, c.candidates, self._kl_gen)
            for forms, score in events:
                for prep in forms:
                    logits, index = self.instant._logits(self.instant._rows(prep, lora), torch.tensor(prep.target),
                                                         prep.negatives, prep.exact)
                    loss = feedback_loss(logits, index, score)
                    total = total + (loss if len(events) == 1 else loss / len(events))
            return total
        return term

    def _publish(self, tenant: str, lora: MicroLora, source: str, checks: dict) -> str:
        """Write the tenant's next version and serve it; unload the one it replaces."""
        from safetensors.torch import save_file

        n = max(self.policy.last_version(tenant), *self._loaded.get(tenant, [0])) + 1
        folder = self.root / _safe(tenant) / f"v{n}"
        folder.mkdir(parents=True, exist_ok=True)
        save_file(lora.peft_tensors(), str(folder / "adapter_model.safetensors"))
        targets = sorted({t for _, t in lora.weights})
        (folder / "adapter_config.json").write_text(json.dumps({
            "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": lora.rank, "lora_alpha": lora.alpha,
            "target_modules": targets, "layers_to_transform": self.layers.layers, "bias": "none",
            "base_model_name_or_path": None}))
        name = _name(tenant, n)
        self._load(tenant, n, folder)
        self.policy.publish(tenant, n, folder, source, checks)
        self._versions[tenant] = n
        if source == "deep":  # the tenant's instant updates continue from the promoted weights
            self._tenants.pop(tenant, None)
        self._trim(tenant, keep=2)
        self._prune(tenant)
        return name

    def _prune(self, tenant: str) -> None:
        """Delete the tenant's version folders beyond the newest `keep_versions`, but never the
        serving one, one loaded in the engine, or a deep-loop promotion (a rollback target that took
        a check to make)."""
        import shutil

        keep = self.config.keep_versions
        if not keep:
            return
        versions = self.policy.versions(tenant)
        if len(versions) <= keep:
            return
        spare = {self._versions.get(tenant), *self._loaded.get(tenant, [])}
        old = [v for v in versions[:-keep] if v.version not in spare and v.source != "deep"]
        for v in old:
            if Path(v.path).parent.parent == self.root:  # only folders this learner wrote
                shutil.rmtree(v.path, ignore_errors=True)
        if old:
            self.policy.forget(tenant, [v.version for v in old])


def under_system(tokenizer: Any, prompt_ids: list[int], system: str) -> list[int] | None:
    """The prompt's one user message rendered again by the model's chat template after `system`;
    None when the prompt is not exactly one user turn of the template (or there is no template)."""
    from ruvllm.engine.prompts import render_chat

    question = user_message(tokenizer, prompt_ids)
    if question is None:
        return None
    return render_chat(tokenizer, [{"role": "system", "content": system}, {"role": "user", "content": question}])


def user_message(tokenizer: Any, prompt_ids: list[int]) -> str | None:
    """The prompt's one user message; None when the prompt is not exactly one user turn of the chat
    template (or there is no template)."""
    from ruvllm.engine.prompts import has_chat_template, render_chat

    if not has_chat_template(tokenizer):
        return None
    mark = "\u2063QUESTION\u2063"  # (an invisible separator: in no ordinary message)
    shape = tokenizer.decode(render_chat(tokenizer, [{"role": "user", "content": mark}]))
    text = tokenizer.decode(prompt_ids)
    head, _, tail = shape.partition(mark)
    if not _ or not text.startswith(head) or not text.endswith(tail) or len(text) <= len(head) + len(tail):
        return None
    question = text[len(head):len(text) - len(tail)]
    if tail.strip() in question or any(t in question for t in tokenizer.all_special_tokens):
        return None  # several turns (their markers inside what would be the one message)
    return question


def _name(tenant: str, n: int) -> str:
    return f"learned:{tenant}:v{n}"


def stack_scope(tenant: str, adapter: str) -> str:
    """The learner's scope (policy-store key, version name `learned:<scope>:v<N>`) of the micro-LoRA
    a tenant learns on a named adapter: `["tenant", "adapter"]` as JSON. It holds a space, which no
    tenant of an API-keys file can (keys and tenants are split at whitespace), so no authenticated
    tenant's own scope is ever a pair's; it is nobody's to name as a model (tenants.may_use)."""
    return json.dumps([tenant, adapter])


def _pair(scope: str) -> tuple[str, str] | None:
    """(tenant, adapter) of a pair's scope, None for a tenant's own (or everyone's)."""
    if not scope.startswith('["'):
        return None
    try:
        value = json.loads(scope)
    except ValueError:
        return None
    if isinstance(value, list) and len(value) == 2 and all(isinstance(v, str) for v in value) \
            and stack_scope(*value) == scope:
        return value[0], value[1]
    return None


def _safe(tenant: str) -> str:
    """A folder name for any tenant name (two tenants never share one)."""
    clean = "".join(c if c.isalnum() or c in "-_." else "_" for c in tenant)[:40]
    return f"{clean}-{hashlib.sha256(tenant.encode()).hexdigest()[:8]}"


def _seed(tenant: str) -> int:
    return int.from_bytes(hashlib.sha256(tenant.encode()).digest()[:4], "little")


def default_learned_dir() -> Path:
    from ruvllm.witness.log import default_witness_path

    return default_witness_path().parent / "learned"
