"""Prometheus metrics for one server, each exposed twice: under vLLM's name and labels, so that
dashboards and alerts written for vLLM read this server unchanged, and under `tailrace:`.

The `vllm:` names, types and labels (`model_name`, `engine`, `finished_reason`) match vLLM's v1
metrics as documented in vllm-project/vllm docs/design/metrics.md (commit 0328b59) and defined in
vllm/v1/metrics/loggers.py (commit 005a810, where `inter_token_latency_seconds` was still called
`time_per_output_token_seconds`; the docs list the new name). The buckets are vLLM's too. vLLM
serves its metrics in multiprocess mode, which writes no `_created` series, so neither does this.

Everything lives in the instance: two servers (or two tests) in one process never share state.
Engine-side numbers are read from `EngineStats` at scrape time rather than pushed.
"""

from __future__ import annotations

import re
from bisect import bisect_left
from collections.abc import Iterator
from dataclasses import dataclass, field

from prometheus_client import CONTENT_TYPE_PLAIN_0_0_4, generate_latest
from prometheus_client.core import (CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, InfoMetricFamily,
                                    Metric)
from prometheus_client.utils import floatToGoString

from tailrace.engine.stats import EngineStats

CONTENT_TYPE = CONTENT_TYPE_PLAIN_0_0_4  # the format generate_latest writes

ENGINE_INDEX = "0"  # vLLM labels each series with its engine core's index; this server has one
# vLLM creates a request_success series for each of its finish reasons up front, so they read 0.
FINISH_REASONS = ("stop", "length", "abort")

_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                10.0, 20.0, 40.0, 80.0)
# vLLM's 1-2-5 ladder for token counts stops at the context length; this one runs on to a million
# tokens, so that it is fixed before the model (and its context length) is loaded.
_TOKEN_BUCKETS = tuple(m * 10**e for e in range(7) for m in (1, 2, 5) if m * 10**e <= 1_000_000)
_E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)


@dataclass(slots=True)
class Histogram:
    bounds: tuple[float, ...]
    counts: list[int] = field(default_factory=list)  # per bucket, not cumulative; the last is +Inf
    total: float = 0.0

    def __post_init__(self) -> None:
        self.counts = [0] * (len(self.bounds) + 1)

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1  # a bucket holds the values <= its bound
        self.total += value

    def cumulative(self) -> list[tuple[str, float]]:
        buckets, running = [], 0
        for bound, count in zip((*map(floatToGoString, self.bounds), "+Inf"), self.counts):
            running += count
            buckets.append((bound, running))
        return buckets


class ServerMetrics:
    """What the API process counts itself (tokens, finishes, latencies), plus the engine's own
    numbers at render time."""

    def __init__(self, model_name: str = "default") -> None:
        self.model_name = model_name
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.finished = dict.fromkeys(FINISH_REASONS, 0)
        self.ttft = Histogram(_TTFT_BUCKETS)
        self.itl = Histogram(_ITL_BUCKETS)
        self.e2e = Histogram(_E2E_BUCKETS)
        self.request_prompt_tokens = Histogram(_TOKEN_BUCKETS)
        self.request_generation_tokens = Histogram(_TOKEN_BUCKETS)
        self.pooling_requests = 0
        self.pooling_prompt_tokens = 0
        self._stats = EngineStats()
        self._backends: dict[str, str] = {}

    def observe_ttft(self, seconds: float) -> None:
        self.ttft.observe(seconds)

    def observe_itl(self, seconds: float) -> None:
        self.itl.observe(seconds)

    def observe_e2e(self, seconds: float) -> None:
        self.e2e.observe(seconds)

    def add_tokens(self, prompt: int, generation: int) -> None:
        self.prompt_tokens += prompt
        self.generation_tokens += generation

    def count_finish(self, reason: str, prompt_tokens: int, generation_tokens: int) -> None:
        """One choice finished (vLLM counts each of n sequences as a request)."""
        self.finished[reason] = self.finished.get(reason, 0) + 1
        self.request_prompt_tokens.observe(prompt_tokens)
        self.request_generation_tokens.observe(generation_tokens)

    def count_pooling(self, prompt_tokens: int) -> None:
        """One embedding request served, its inputs' tokens pooled."""
        self.pooling_requests += 1
        self.pooling_prompt_tokens += prompt_tokens

    def render(self, stats: EngineStats, backends: dict[str, str] | None = None) -> bytes:
        """The Prometheus text exposition, with the engine's numbers taken from `stats` and what
        runs the model from `backends` (model/backends.py's record; None before the model loads)."""
        self._stats = stats
        self._backends = backends or {}
        return generate_latest(self)  # type: ignore[arg-type]  # it only calls collect()

    def collect(self) -> Iterator[Metric]:
        vllm = _Names("vllm:", {"model_name": self.model_name, "engine": ENGINE_INDEX})
        own = _Names("tailrace:", {"model_name": self.model_name})
        for names in (vllm, own):
            yield from self._families(names)
        s = self._stats
        yield own.gauge("num_free_kv_blocks", "Free KV-cache blocks.", s.num_free_blocks)
        yield own.gauge("num_total_kv_blocks", "All KV-cache blocks.", s.num_total_blocks)
        yield own.counter("pooling_requests", "Embedding requests served.", self.pooling_requests)
        yield own.counter("pooling_prompt_tokens", "Tokens pooled into embeddings.", self.pooling_prompt_tokens)
        if self._backends:
            # Label names are identifiers: "fused forward not taken" becomes fused_forward_not_taken.
            labels = {re.sub(r"\W+", "_", key): value for key, value in self._backends.items()}
            yield InfoMetricFamily("tailrace:backend", "What runs the model, and why not the faster paths.",
                                   value={**own.labels, **labels})

    def _families(self, names: _Names) -> Iterator[Metric]:
        s = self._stats
        yield names.gauge("num_requests_running", "Number of requests in model execution batches.", s.num_running)
        yield names.gauge("num_requests_waiting", "Number of requests waiting to be processed.", s.num_waiting)
        yield names.gauge("kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", s.kv_usage)
        yield names.counter("prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.",
                            s.prefix_cache_queries)
        yield names.counter("prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.",
                            s.prefix_cache_hits)
        yield names.counter("num_preemptions", "Cumulative number of preemption from the engine.", s.num_preemptions)
        if s.spec_accepted_per_position:  # speculative decoding is on
            yield from _speculation(names, s)
        yield names.counter("prompt_tokens", "Number of prefill tokens processed.", self.prompt_tokens)
        yield names.counter("generation_tokens", "Number of generation tokens processed.", self.generation_tokens)
        success = CounterMetricFamily(names.prefix + "request_success", "Count of successfully processed requests.",
                                      labels=[*names.labels, "finished_reason"])
        for reason, count in self.finished.items():
            success.add_metric([*names.labels.values(), reason], count)
        yield success
        yield names.histogram("request_prompt_tokens", "Number of prefill tokens processed.",
                              self.request_prompt_tokens)
        yield names.histogram("request_generation_tokens", "Number of generation tokens processed.",
                              self.request_generation_tokens)
        yield names.histogram("time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                              self.ttft)
        yield names.histogram("inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                              self.itl)
        yield names.histogram("e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
                              self.e2e)


def _speculation(names: _Names, s: EngineStats) -> Iterator[Metric]:
    yield names.counter("spec_decode_num_drafts", "Number of spec decoding drafts.", s.spec_num_drafts)
    yield names.counter("spec_decode_num_draft_tokens", "Number of draft tokens.", s.spec_num_draft_tokens)
    yield names.counter("spec_decode_num_accepted_tokens", "Number of accepted tokens.", s.spec_num_accepted_tokens)
    per_position = CounterMetricFamily(names.prefix + "spec_decode_num_accepted_tokens_per_pos",
                                       "Accepted tokens per draft position.", labels=[*names.labels, "position"])
    for position, count in enumerate(s.spec_accepted_per_position):
        per_position.add_metric([*names.labels.values(), str(position)], count)
    yield per_position


@dataclass(slots=True)
class _Names:
    """One naming scheme: a prefix and the label set every series carries."""

    prefix: str
    labels: dict[str, str]

    def gauge(self, name: str, doc: str, value: float) -> Metric:
        return self._single(GaugeMetricFamily, name, doc, value)

    def counter(self, name: str, doc: str, value: float) -> Metric:
        return self._single(CounterMetricFamily, name, doc, value)

    def _single(self, kind: type, name: str, doc: str, value: float) -> Metric:
        family = kind(self.prefix + name, doc, labels=list(self.labels))
        family.add_metric(list(self.labels.values()), value)
        return family

    def histogram(self, name: str, doc: str, histogram: Histogram) -> Metric:
        family = HistogramMetricFamily(self.prefix + name, doc, labels=list(self.labels))
        family.add_metric(list(self.labels.values()), histogram.cumulative(), histogram.total)
        return family
