"""Prometheus metrics, names prefixed `ruvllm:`, in a registry of the app's own (no global state)."""

from __future__ import annotations

import copy
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from ruvllm.engine.core_client import ReplicaState

if TYPE_CHECKING:
    from ruvllm.outputs import RequestOutput

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160)
_ITL_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1, 2.5)


class _EngineCollector(Collector):
    """Reads each engine core's latest stats at scrape time (published by the core after each step),
    one series per replica (`replica` label: "0" for a single core; data-parallel replicas 0..N-1)."""

    def __init__(self, replicas: Callable[[], list[ReplicaState]], model: str,
                 models: Callable[[], list[tuple[str, list[ReplicaState]]]] | None = None) -> None:
        # models: a many-model server's loaded engines (server/model_pool.py), each labelled with its name
        self._engines = models or (lambda: [(model, replicas())])

    _FAMILIES = (  # (kind, name, help, a replica's value)
        (GaugeMetricFamily, "ruvllm:num_requests_running", "Requests in the running batch.", "running"),
        (GaugeMetricFamily, "ruvllm:num_requests_waiting", "Requests waiting (incl. preempted).", "waiting"),
        (GaugeMetricFamily, "ruvllm:kv_cache_usage_perc", "Fraction of KV-cache blocks in use (0-1).", "kv_usage"),
        (CounterMetricFamily, "ruvllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
         "prefix_queries"),
        (CounterMetricFamily, "ruvllm:prefix_cache_hits", "Prompt tokens served from the prefix cache.",
         "prefix_hits"),
        # The KV tiers (docs/architecture.md): memory (the prefix cache's hot and cold blocks) and disk
        (CounterMetricFamily, "ruvllm:prefix_cache_misses", "Prompt tokens looked up in the prefix cache that "
         "it lacked (memory tier).", lambda rep: rep.stats.prefix_queries - rep.stats.prefix_hits),
        (CounterMetricFamily, "ruvllm:kv_disk_queries", "Prompt tokens past the memory hits looked up in the "
         "disk KV tier.", "disk_queries"),
        (CounterMetricFamily, "ruvllm:kv_disk_hits", "Prompt tokens loaded from the disk KV tier.", "disk_hits"),
        (CounterMetricFamily, "ruvllm:kv_disk_misses", "Prompt tokens looked up in the disk KV tier that it "
         "lacked.", lambda rep: rep.stats.disk_queries - rep.stats.disk_hits),
        (GaugeMetricFamily, "ruvllm:kv_hot_bytes", "Bytes of KV blocks in use in the hot (16/32-bit) tier.",
         "hot_bytes"),
        (GaugeMetricFamily, "ruvllm:kv_cold_bytes", "Bytes of KV blocks in use in the quantized cold tier.",
         "cold_bytes"),
        (GaugeMetricFamily, "ruvllm:kv_disk_bytes", "Bytes of block files in the disk KV tier.", "disk_bytes"),
        (CounterMetricFamily, "ruvllm:num_preemptions", "Requests preempted (by recompute) so far.", "preemptions"),
        (CounterMetricFamily, "ruvllm:spec_decode_num_draft_tokens", "Speculative decoding: tokens proposed.",
         "spec_proposed"),
        (CounterMetricFamily, "ruvllm:spec_decode_num_accepted_tokens",
         "Speculative decoding: proposed tokens accepted.", "spec_accepted"),
        (CounterMetricFamily, "ruvllm:spec_decode_num_verifications",
         "Speculative decoding: sequence-steps that scored proposals.", "spec_verifications"),
        (GaugeMetricFamily, "ruvllm:spec_decode_acceptance_rate",
         "Speculative decoding: accepted / proposed tokens so far (0-1).", "spec_acceptance_rate"),
        (GaugeMetricFamily, "ruvllm:spec_decode_mean_accepted_length",
         "Speculative decoding: tokens per verification step (accepted proposals + 1).",
         "spec_mean_accepted_length"),
        (GaugeMetricFamily, "ruvllm:replica_up", "1 while the engine core serves (0: restarting or failed).",
         lambda rep: 1.0 if rep.status == "up" else 0.0),
        (CounterMetricFamily, "ruvllm:replica_restarts", "Times the engine core was started again after it failed.",
         lambda rep: rep.restarts),
    )

    def collect(self) -> Iterator[Any]:
        engines = self._engines()
        for family, name, doc, value in self._FAMILIES:
            metric = family(name, doc, labels=["model_name", "replica"])
            for model, replicas in engines:
                for rep in replicas:
                    v = value(rep) if callable(value) else getattr(rep.stats, value)
                    metric.add_metric([model, str(rep.index)], float(v))
            yield metric


class ServerMetrics:
    def __init__(self, replicas: Callable[[], list[ReplicaState]], model: str,
                 models: Callable[[], list[tuple[str, list[ReplicaState]]]] | None = None) -> None:
        self.registry = r = CollectorRegistry()
        self.model = model
        r.register(_EngineCollector(replicas, model, models))
        lab = ["model_name", "endpoint"]  # endpoint: the API path (each dialect has its own)
        self.prompt_tokens = Counter("ruvllm:prompt_tokens", "Prompt tokens processed.", lab, registry=r)
        self.generation_tokens = Counter("ruvllm:generation_tokens", "Tokens generated.", lab, registry=r)
        self.request_success = Counter("ruvllm:request_success", "Finished requests by finish reason.",
                                       lab + ["finished_reason"], registry=r)
        self.ttft = Histogram("ruvllm:time_to_first_token_seconds", "Time to first token.", lab,
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("ruvllm:inter_token_latency_seconds", "Time between output tokens.", lab,
                             buckets=_ITL_BUCKETS, registry=r)
        self.e2e = Histogram("ruvllm:e2e_request_latency_seconds", "Arrival to finish.", lab,
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.queue_time = Histogram("ruvllm:request_queue_time_seconds", "Arrival to first scheduled.", lab,
                                    buckets=_LATENCY_BUCKETS, registry=r)



    def pooled(self, endpoint: str, prompt_lengths: list[int], queue_times: list[float | None],
               seconds: float) -> None:
        """A call of pooled inputs (embeddings, scored pairs: nothing generated): its latency, its prompt
        tokens, each input a success, and each one's wait in the queue."""
        labels = (self.model, endpoint)
        self.e2e.labels(*labels).observe(seconds)
        self.prompt_tokens.labels(*labels).inc(sum(prompt_lengths))
        self.request_success.labels(*labels, "stop").inc(len(prompt_lengths))
        for q in queue_times:
            if q is not None:
                self.queue_time.labels(*labels).observe(q)

    def for_model(self, model: str) -> ServerMetrics:
        """The same series (one registry) with requests labelled `model`: a many-model server's view per model."""
        view = copy.copy(self)
        view.model = model
        return view


class RequestTracker:
    """Latency bookkeeping of one HTTP request across its stream of engine outputs."""

    def __init__(self, m: ServerMetrics, endpoint: str) -> None:
        self.m, self.start = m, time.monotonic()
        self.labels = (m.model, endpoint)
        self.first: float | None = None  # when the first token came (Ollama's bodies split the time there)
        self.last: float | None = None
        self._itl: Any = None  # this request's inter-token series, looked up once (not per token)

    def on_output(self, out: RequestOutput) -> None:
        """`out`: a DELTA output (what it adds, over all its completions)."""
        now = time.monotonic()
        new = sum(len(c.token_ids) for c in out.outputs)
        if new <= 0:
            return
        label = self.labels
        if self.last is None:
            self.first = now
            self.m.ttft.labels(*label).observe(now - self.start)
            if out.queue_time is not None:
                self.m.queue_time.labels(*label).observe(out.queue_time)
        else:
            # Several tokens can arrive in one output (n > 1); spread the gap over them.
            if self._itl is None:
                self._itl = self.m.itl.labels(*label)
            for _ in range(new):
                self._itl.observe((now - self.last) / new)
        self.last = now

    def on_finish(self, results: list[RequestOutput]) -> None:
        label = self.labels
        self.m.e2e.labels(*label).observe(time.monotonic() - self.start)
        self.m.prompt_tokens.labels(*label).inc(sum(len(r.prompt_token_ids) for r in results))
        self.m.generation_tokens.labels(*label).inc(sum(len(c.token_ids) for r in results for c in r.outputs))
        for c in (c for r in results for c in r.outputs if c.finish_reason is not None):
            self.m.request_success.labels(*label, c.finish_reason.value).inc()
