"""Prometheus metrics at /metrics, named as vLLM's with a `baton:` prefix.

Two sources, one registry of the frontend's own (never the process-global default):
- the scheduler's aggregate stats, fetched at scrape time: running/waiting requests, KV-cache
  usage, and server-wide token and preemption totals (so requests of other ZMQ clients count);
- latencies the frontend observes per request (TTFT, inter-token latency, end-to-end) and
  successful requests by finish reason.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from baton.messages import GenerateDelta
from baton.scheduler_stats import AggregateStats

PREFIX = "baton:"
# vLLM's buckets, with finer low ends for fast decode steps.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
ITL_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
               2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)  # fmt: skip
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
               120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)  # fmt: skip


class SchedulerStatsCollector(Collector):
    """Exposes the scheduler stats last handed to `update` (nothing before the first)."""

    def __init__(self, model_name: str) -> None:
        self._labels = [model_name]
        self._stats: AggregateStats | None = None

    def update(self, stats: AggregateStats | None) -> None:
        """Use `stats` for the next collection (None: the pipeline did not answer)."""
        self._stats = stats

    def collect(self) -> Iterator[Metric]:
        if self._stats is None:
            return
        # With data-parallel replicas, each is a series of its own, labelled `engine` as vLLM
        # labels its DP engines.
        replicas = self._stats.replicas or [self._stats]
        families: dict[str, Metric] = {}
        for stats in replicas:
            engine = [str(stats.replica)] if self._stats.replicas else []
            for kind, name, doc, value in self._values(stats):
                if name not in families:
                    labels = ["model_name", "engine"] if engine else ["model_name"]
                    families[name] = kind(PREFIX + name, doc, labels=labels)
                families[name].add_metric(self._labels + engine, value)
        yield from families.values()

    @staticmethod
    def _values(stats: AggregateStats) -> Iterator[tuple[type, str, str, float]]:
        """(family kind, name, doc, value) of every metric one scheduler's stats give."""
        total = stats.total_pages or 1
        for name, doc, value in (
            ("num_requests_running", "Requests being generated.", stats.running_requests),
            ("num_requests_waiting", "Requests waiting to be scheduled.", stats.waiting_requests),
            ("num_requests_paused", "Requests paused for a reader that fell behind.",
             stats.paused_requests),
            ("kv_cache_usage_perc", "Fraction of KV pages held by requests (0-1).",
             stats.used_pages / total),
            ("kv_cache_peak_usage_perc", "The largest fraction of KV pages requests held at once.",
             stats.peak_used_pages / total),
            ("peak_memory_bytes", "Peak resident memory of the scheduler process.",
             stats.peak_memory_bytes),
            ("engine_step_seconds", "How long the engine's current step has run (0: between "
             "steps, or under 50 ms).", stats.engine_step_seconds),
        ):  # fmt: skip
            yield GaugeMetricFamily, name, doc, value
        for name, doc, value in (
            ("prompt_tokens", "Prompt tokens of finished requests.", stats.prompt_tokens),
            ("generation_tokens", "Generated tokens.", stats.generated_tokens),
            ("num_preemptions", "Requests preempted for KV space.", stats.preemptions),
            ("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
             stats.prompt_tokens),
            ("prefix_cache_hits", "Prompt tokens found in the prefix cache.",
             stats.cached_prompt_tokens),
            ("spec_decode_num_drafts", "Steps that verified drafts.", stats.spec_decode_num_drafts),
            ("spec_decode_num_draft_tokens", "Draft tokens verified.",
             stats.spec_decode_num_draft_tokens),
            ("spec_decode_num_accepted_tokens", "Draft tokens accepted.",
             stats.spec_decode_num_accepted_tokens),
        ):  # fmt: skip
            yield CounterMetricFamily, name, doc, value


class FrontendMetrics:
    """The frontend's registry; `track()` gives each pipeline request its observer."""

    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        self.scheduler = SchedulerStatsCollector(model_name)
        self.registry.register(self.scheduler)
        self.time_to_first_token = Histogram(
            PREFIX + "time_to_first_token_seconds",
            "Time from request arrival to its first token.",
            ["model_name"],
            buckets=TTFT_BUCKETS,
            registry=self.registry,
        ).labels(model_name)
        self.inter_token_latency = Histogram(
            PREFIX + "inter_token_latency_seconds",
            "Time between consecutive tokens of a request.",
            ["model_name"],
            buckets=ITL_BUCKETS,
            registry=self.registry,
        ).labels(model_name)
        self.e2e_latency = Histogram(
            PREFIX + "e2e_request_latency_seconds",
            "Time from request arrival to its last token.",
            ["model_name"],
            buckets=E2E_BUCKETS,
            registry=self.registry,
        ).labels(model_name)
        self._success = Counter(
            PREFIX + "request_success",
            "Finished requests, by finish reason.",
            ["model_name", "finished_reason"],
            registry=self.registry,
        )
        self._model_name = model_name

    def track(self) -> RequestTracker:
        """An observer for one request arriving now."""
        return RequestTracker(self)

    def count_success(self, finish_reason: str) -> None:
        """Count one finished request."""
        self._success.labels(self._model_name, finish_reason).inc()

    def render(self, stats: AggregateStats | None) -> bytes:
        """The exposition text, with `stats` as the scheduler's current state."""
        self.scheduler.update(stats)
        return generate_latest(self.registry)


class RequestTracker:
    """Observes one request's token timings from its deltas."""

    __slots__ = ("_arrival", "_last_token", "_metrics")

    def __init__(self, metrics: FrontendMetrics) -> None:
        self._metrics = metrics
        self._arrival = time.perf_counter()
        self._last_token: float | None = None

    def observe(self, delta: GenerateDelta) -> None:
        """Record a delta's arrival: TTFT or inter-token latency, and the end if it is final."""
        now = time.perf_counter()
        count = len(delta.token_ids)
        if count:
            if self._last_token is None:
                self._metrics.time_to_first_token.observe(now - self._arrival)
                # Tokens that came with the first one took no extra time.
                following, interval = count - 1, 0.0
            else:
                # Tokens arriving together share the elapsed time evenly.
                following, interval = count, (now - self._last_token) / count
            for _ in range(following):
                self._metrics.inter_token_latency.observe(interval)
            self._last_token = now
        if delta.finished:
            self._metrics.e2e_latency.observe(now - self._arrival)
            self._metrics.count_success(delta.finish_reason or "stop")
