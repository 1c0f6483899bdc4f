"""The periodic stats line: what it says, and that it stays quiet when the server is idle."""

import asyncio
import logging

from tailrace.api.stats_log import Totals, log_stats, stats_line
from tailrace.engine.stats import EngineStats
from tailrace.metrics import ServerMetrics

IDLE = Totals(at=0.0, prompt_tokens=100, generation_tokens=50, cache_queries=40, cache_hits=10)


def test_line_gives_throughput_queue_kv_usage_and_hit_rate_over_the_interval():
    now = Totals(at=10.0, prompt_tokens=300, generation_tokens=550, cache_queries=80, cache_hits=40)
    line = stats_line(IDLE, now, EngineStats(num_running=3, num_waiting=1, kv_usage=0.125))
    assert line == ("Avg prompt throughput: 20.0 tokens/s, Avg generation throughput: 50.0 tokens/s, "
                    "Running: 3 reqs, Waiting: 1 reqs, KV cache usage: 12.5%, Prefix cache hit rate: 75.0%")


def test_no_line_when_nothing_ran_waited_or_happened():
    assert stats_line(IDLE, Totals(10.0, 100, 50, 40, 10), EngineStats()) is None


def test_a_line_while_requests_wait_even_with_no_tokens():
    assert stats_line(IDLE, Totals(10.0, 100, 50, 40, 10), EngineStats(num_waiting=2)) is not None


def test_a_line_for_an_interval_whose_work_has_finished():
    assert stats_line(IDLE, Totals(10.0, 100, 51, 40, 10), EngineStats()) is not None


def test_logger_logs_only_intervals_with_work(caplog):
    metrics = ServerMetrics()
    stats = EngineStats()

    async def run():
        task = asyncio.create_task(log_stats(metrics, lambda: stats, interval_s=0.01))
        await asyncio.sleep(0.035)  # idle intervals
        metrics.add_tokens(prompt=5, generation=7)
        await asyncio.sleep(0.03)
        task.cancel()

    with caplog.at_level(logging.INFO, logger="tailrace.stats"):
        asyncio.run(run())
    assert len(caplog.records) == 1 and "Avg generation throughput" in caplog.records[0].getMessage()
