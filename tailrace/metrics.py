"""Prometheus metrics for one server, named like vLLM's (`vllm:` -> `tailrace:`) so dashboards carry over.

Everything lives in the instance's own registry: two servers (or two tests) in one process never share
state. Engine-side numbers are read from `EngineStats` at scrape time rather than pushed.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CONTENT_TYPE_PLAIN_0_0_4, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from tailrace.engine.stats import EngineStats

CONTENT_TYPE = CONTENT_TYPE_PLAIN_0_0_4  # the format generate_latest writes

_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
                 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0)
_ITL_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5,
                0.75, 1.0, 2.5, 5.0, 10.0)
_E2E_BUCKETS = (0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0,
                60.0, 120.0, 240.0, 480.0, 960.0)


class ServerMetrics:
    def __init__(self, model_name: str = "default") -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        labels = {"model_name": model_name}
        self._engine = _EngineCollector(labels)
        self.registry.register(self._engine)
        self._prompt_tokens = Counter(
            "tailrace:prompt_tokens", "Prompt tokens processed.", list(labels),
            registry=self.registry).labels(**labels)
        self._generation_tokens = Counter(
            "tailrace:generation_tokens", "Tokens generated.", list(labels),
            registry=self.registry).labels(**labels)
        self._finished = Counter(
            "tailrace:request_success", "Finished requests (choices) by finish reason.",
            [*labels, "finished_reason"], registry=self.registry)
        self._labels = labels
        self._ttft = Histogram(
            "tailrace:time_to_first_token_seconds", "Time from arrival to the first generated token.",
            list(labels), buckets=_TTFT_BUCKETS, registry=self.registry).labels(**labels)
        self._itl = Histogram(
            "tailrace:inter_token_latency_seconds", "Time between consecutive generated tokens.",
            list(labels), buckets=_ITL_BUCKETS, registry=self.registry).labels(**labels)
        self._e2e = Histogram(
            "tailrace:e2e_request_latency_seconds", "Time from arrival to the last token.",
            list(labels), buckets=_E2E_BUCKETS, registry=self.registry).labels(**labels)

    def observe_ttft(self, seconds: float) -> None:
        self._ttft.observe(seconds)

    def observe_itl(self, seconds: float) -> None:
        self._itl.observe(seconds)

    def observe_e2e(self, seconds: float) -> None:
        self._e2e.observe(seconds)

    def add_tokens(self, prompt: int, generation: int) -> None:
        self._prompt_tokens.inc(prompt)
        self._generation_tokens.inc(generation)

    def count_finish(self, reason: str) -> None:
        self._finished.labels(**self._labels, finished_reason=reason).inc()

    def render(self, stats: EngineStats) -> bytes:
        """The Prometheus text exposition, with the engine gauges taken from `stats`."""
        self._engine.stats = stats
        return generate_latest(self.registry)


class _EngineCollector(Collector):
    """Reports the latest EngineStats. The engine keeps its own cumulative counts, so they are
    exposed as counters read as-is rather than incremented here."""

    def __init__(self, labels: dict[str, str]) -> None:
        self.labels = labels
        self.stats = EngineStats()

    def collect(self) -> Iterator[Metric]:
        s = self.stats
        gauges = (
            ("tailrace:num_requests_running", "Requests being generated.", s.num_running),
            ("tailrace:num_requests_waiting", "Requests waiting to be scheduled.", s.num_waiting),
            ("tailrace:kv_cache_usage_perc", "Fraction of KV-cache blocks in use (0 to 1).", s.kv_usage),
            ("tailrace:num_free_kv_blocks", "Free KV-cache blocks.", s.num_free_blocks),
            ("tailrace:num_total_kv_blocks", "All KV-cache blocks.", s.num_total_blocks),
        )
        counters = (
            ("tailrace:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
             s.prefix_cache_queries),
            ("tailrace:prefix_cache_hits", "Prompt tokens found in the prefix cache.", s.prefix_cache_hits),
            ("tailrace:num_preemptions", "Requests preempted for lack of KV blocks.", s.num_preemptions),
        )
        names, values = list(self.labels), list(self.labels.values())
        for name, doc, value in gauges:
            family = GaugeMetricFamily(name, doc, labels=names)
            family.add_metric(values, value)
            yield family
        for name, doc, value in counters:
            family = CounterMetricFamily(name, doc, labels=names)
            family.add_metric(values, value)
            yield family
