"""The periodic stats line, like vLLM's: throughput, queue and KV cache in the log while there is work.

Read from what the API process already has (its own token counters and the engine's latest
`EngineStats`), so the engine core does no extra work for it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from tailrace.engine.stats import EngineStats
from tailrace.metrics import ServerMetrics

log = logging.getLogger("tailrace.stats")

INTERVAL_S = 10.0  # vLLM's default


@dataclass(slots=True, frozen=True)
class Totals:
    """The cumulative counts at one moment; a stats line is the difference of two."""

    at: float
    prompt_tokens: int
    generation_tokens: int
    cache_queries: int
    cache_hits: int


def totals(metrics: ServerMetrics, stats: EngineStats, at: float) -> Totals:
    return Totals(at, metrics.prompt_tokens, metrics.generation_tokens, stats.prefix_cache_queries,
                  stats.prefix_cache_hits)


def stats_line(before: Totals, now: Totals, stats: EngineStats) -> str | None:
    """The line for the interval from `before` to `now`; None when nothing ran, waited or happened."""
    changed = (now.prompt_tokens, now.generation_tokens, now.cache_queries) != (
        before.prompt_tokens, before.generation_tokens, before.cache_queries)
    if not (changed or stats.num_running or stats.num_waiting):
        return None
    seconds = max(now.at - before.at, 1e-9)
    queries = now.cache_queries - before.cache_queries
    hit_rate = (now.cache_hits - before.cache_hits) / queries if queries else 0.0
    return (f"Avg prompt throughput: {(now.prompt_tokens - before.prompt_tokens) / seconds:.1f} tokens/s, "
            f"Avg generation throughput: {(now.generation_tokens - before.generation_tokens) / seconds:.1f} "
            f"tokens/s, Running: {stats.num_running} reqs, Waiting: {stats.num_waiting} reqs, "
            f"KV cache usage: {stats.kv_usage * 100:.1f}%, Prefix cache hit rate: {hit_rate * 100:.1f}%")


async def log_stats(metrics: ServerMetrics, engine_stats: Callable[[], EngineStats],
                    interval_s: float = INTERVAL_S) -> None:
    """Log a stats line every `interval_s` that had work, until cancelled."""
    before = totals(metrics, engine_stats(), time.monotonic())
    while True:
        await asyncio.sleep(interval_s)
        stats = engine_stats()
        now = totals(metrics, stats, time.monotonic())
        line = stats_line(before, now, stats)
        if line is not None:
            log.info("%s", line)
        before = now
