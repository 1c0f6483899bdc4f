"""Every concurrency level of `tailrace bench serve` against one server (`run_benchmark`), each in
this process or split over several client processes (`run_level_processes`).

One asyncio process reading SSE through httpx spends about 120-150 us of CPU a streamed token, so
past about 7,000 tokens/s it is the client, not the server, that sets the figure: on the H200 the
load generator used 0.84-0.89 of a core at 7,400 tok/s (the HTTP phase of `bash bench/gpu.sh`). With
`--processes N` each process sends every N-th prompt at 1/N of the concurrency (and of a Poisson
rate: the sum of independent Poisson arrivals is the whole rate), over its own connections; all
start together behind a barrier, and their records are merged in prompt order.
"""

from __future__ import annotations

import asyncio
import dataclasses
import multiprocessing
import queue
from typing import Any

from tailrace.bench.records import LevelResult
from tailrace.bench.serve import (BenchError, LoadConfig, Workload, build_workload, first_model, open_client,
                                  run_level, warm_up)

START_TIMEOUT_S = 120.0  # a child imports tailrace (and torch) before it can start


def shard_sizes(total: int, processes: int) -> list[int]:
    """`total` (the concurrency) split into `processes` parts differing by at most one."""
    return [total // processes + (k < total % processes) for k in range(processes)]


def run_level_processes(config: LoadConfig, model: str, workload: Workload, concurrency: int) -> LevelResult:
    """run_level's result for the whole workload, from `config.processes` client processes."""
    processes = min(config.processes, concurrency, len(workload.prompts))
    context = multiprocessing.get_context("spawn")  # no fork of a parent that may hold threads
    barrier, results = context.Barrier(processes), context.Queue()
    children = []
    for shard, share in enumerate(shard_sizes(concurrency, processes)):
        indices = list(range(shard, len(workload.prompts), processes))
        shard_config = dataclasses.replace(config, processes=1, progress=False, seed=config.seed + shard,
                                           request_rate=config.request_rate / processes)
        shard_workload = dataclasses.replace(workload, prompts=[workload.prompts[i] for i in indices])
        child = context.Process(target=_run_shard, daemon=True,
                                args=(shard_config, model, shard_workload, share, indices, barrier, results))
        child.start()
        children.append(child)
    try:
        shards = [_take(results, config.timeout_s + START_TIMEOUT_S) for _ in children]
    finally:
        for child in children:
            child.join(timeout=5)
            if child.is_alive():
                child.kill()
    records = sorted((r for shard in shards for r in shard.records), key=lambda r: r.index)
    return LevelResult(concurrency=concurrency, request_rate=config.request_rate,
                       duration=max(shard.duration for shard in shards), records=records)


def _take(results: Any, timeout_s: float) -> LevelResult:
    try:
        outcome = results.get(timeout=timeout_s)
    except queue.Empty:
        raise BenchError(f"a client process sent no result within {timeout_s:.0f} s") from None
    if isinstance(outcome, str):
        raise BenchError(f"a client process failed: {outcome}")
    return outcome


def _run_shard(config: LoadConfig, model: str, workload: Workload, concurrency: int, indices: list[int],
               barrier: Any, results: Any) -> None:
    """A child: its prompts at its concurrency, once every child is ready; the records carry the
    prompts' indices in the whole workload."""
    async def main() -> LevelResult:
        async with open_client(config) as client:
            barrier.wait(START_TIMEOUT_S)  # blocks the loop, which has nothing else to do yet
            return await run_level(client, config, model, workload, concurrency)

    try:
        level = asyncio.run(main())
    except BaseException as exc:  # the parent must hear of it rather than wait out its timeout
        barrier.abort()
        results.put(f"{type(exc).__name__}: {exc}")
        return
    for record in level.records:
        record.index = indices[record.index]
    results.put(level)


async def run_benchmark(config: LoadConfig) -> tuple[str, Workload, list[LevelResult]]:
    """Every concurrency level against one server: (model name, prompts, levels)."""
    async with open_client(config) as client:
        model = config.model or await first_model(client, config)
        workload = await build_workload(client, config, model)
        await warm_up(client, config, model, workload.prompts[0])
        levels = [await run_level(client, config, model, workload, c) if config.processes == 1
                  else await asyncio.to_thread(run_level_processes, config, model, workload, c)
                  for c in config.concurrency]
    return model, workload, levels

