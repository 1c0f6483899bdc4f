"""Disconnect storm: many concurrent streams, a random part of which hang up at random moments:
most at a random point of their own stream, some early, after a random time, likely still queued.

The streams that stay must all complete without an error, and once the last stream has ended the
engine must be back to idle (no request running or waiting, KV usage as before the storm) within
the deadline. Starts its own `tailrace serve` with the embedded model unless --url is given.

    .venv/bin/python bench/disconnect_storm.py --streams 200 --json bench/out/disconnect_storm.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import time
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx

from harness import API_KEY, KV_USAGE, MODEL, Server, ServerProcess, finish_reasons, read_stream

IDLE_DEADLINE_S = 2.0
EARLY_FRACTION = 0.2  # of the streams that hang up, those that do so after a random time, not a random chunk


@dataclass(slots=True)
class StormResult:
    streams: int
    disconnected: int
    hang_ups: dict[str, int]  # when the disconnecting streams hung up
    completed: int
    errors: list[str]
    storm_s: float
    idle_after_s: float | None  # None: not idle within the deadline
    idle_deadline_s: float

    @property
    def passed(self) -> bool:
        return not self.errors and self.idle_after_s is not None


def request_for(rng: random.Random, index: int, max_tokens: int) -> tuple[str, dict]:
    body = {"model": MODEL, "max_tokens": max_tokens, "ignore_eos": True, "stream": True,
            "temperature": 1.0, "seed": index}
    if rng.random() < 0.5:
        return "/v1/completions", {**body, "prompt": f"Story number {index}: once upon a time"}
    return "/v1/chat/completions", {**body, "messages": [{"role": "user", "content": f"Tell story {index}."}]}


async def stay(client: httpx.AsyncClient, path: str, body: dict) -> str | None:
    """Read a stream to its end; what was wrong with it, or None."""
    chunks, problem = await read_stream(client, path, body)
    if problem is None and finish_reasons(chunks) != ["length"]:
        problem = "no single finish_reason 'length'"
    return None if problem is None else f"{path}: {problem}"


async def leave(client: httpx.AsyncClient, path: str, body: dict, after_s: float, after_events: int) -> str:
    """Start a stream and hang up after `after_events` SSE events or `after_s` seconds, whichever
    comes first; when that was: "before the first byte", "mid-stream" or "too late" (it had ended).

    A timer cancels this very task (no wait_for, whose extra task would start the request one loop
    turn after the streams that stay, so that they would all be ahead in the server's queue)."""
    events = 0
    hung_up = False
    task = asyncio.current_task()

    def hang_up() -> None:
        nonlocal hung_up
        hung_up = True
        task.cancel()

    timer = asyncio.get_running_loop().call_later(after_s, hang_up)
    try:
        async with client.stream("POST", path, json=body) as response:
            async for line in response.aiter_lines():
                events += line.startswith("data: ")
                if events == after_events:
                    return "mid-stream"
    except asyncio.CancelledError:
        if not hung_up:
            raise
        return "mid-stream" if events else "before the first byte"
    finally:
        timer.cancel()
    return "too late"


async def storm(url: str, headers: dict[str, str], streams: int, fraction: float, max_tokens: int,
                window_s: float, seed: int) -> tuple[dict[str, int], list[str], float]:
    rng = random.Random(seed)
    limits = httpx.Limits(max_connections=streams + 8, max_keepalive_connections=streams + 8)
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=300, limits=limits) as client:
        tasks, leaves = [], []  # in arrival order, so that leavers and stayers share the queue fairly
        started = time.monotonic()
        for index in range(streams):
            path, body = request_for(rng, index, max_tokens)
            leaves.append(rng.random() < fraction)
            if not leaves[-1]:
                tasks.append(stay(client, path, body))
            elif rng.random() < EARLY_FRACTION:  # gives up early, most likely while still queued
                tasks.append(leave(client, path, body, rng.uniform(0.0, window_s), after_events=-1))
            else:  # at a random point of its own stream (a chunk may carry several tokens: half at most)
                tasks.append(leave(client, path, body, float("inf"), rng.randint(1, max_tokens // 2)))
        outcomes = await asyncio.gather(*tasks)
        errors = [o for o, left in zip(outcomes, leaves) if not left and o is not None]
        hang_ups = Counter(o for o, left in zip(outcomes, leaves) if left)
        return dict(hang_ups), errors, time.monotonic() - started


def run(server: Server, streams: int, fraction: float, max_tokens: int, window_s: float,
        seed: int) -> StormResult:
    idle_kv = server.gauges()[KV_USAGE]
    hang_ups, errors, storm_s = asyncio.run(storm(server.url, server.headers, streams, fraction, max_tokens,
                                                  window_s, seed))
    idle_after = server.wait_idle(idle_kv, IDLE_DEADLINE_S)
    leaving = sum(hang_ups.values())
    return StormResult(streams, leaving, hang_ups, streams - leaving - len(errors), errors, round(storm_s, 2),
                       None if idle_after is None else round(idle_after, 3), IDLE_DEADLINE_S)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", type=int, default=200)
    parser.add_argument("--disconnect-fraction", type=float, default=0.5)
    parser.add_argument("--max-tokens", type=int, default=128, help="tokens each stream asks for (ignore_eos)")
    parser.add_argument("--window", type=float, default=2.0,
                        help="an early hang-up falls at random in [0, window] s")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--url", help="an already running server (default: start one)")
    parser.add_argument("--api-key", default=API_KEY)
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args(argv)

    def measure(server: Server) -> StormResult:
        return run(server, args.streams, args.disconnect_fraction, args.max_tokens, args.window, args.seed)

    if args.url:
        result = measure(Server(args.url, args.api_key))
    else:
        with ServerProcess(Path(tempfile.mkdtemp()) / "server.log") as server:
            server.wait_healthy()
            result = measure(server)
    figures = {**asdict(result), "passed": result.passed, "command": " ".join(sys.argv)}
    print(f"{result.streams} streams, {result.disconnected} hung up {result.hang_ups}, {result.completed} completed, "
          f"{len(result.errors)} errors; storm {result.storm_s:.1f} s; idle again after "
          f"{'-' if result.idle_after_s is None else f'{result.idle_after_s:.3f}'} s "
          f"(deadline {IDLE_DEADLINE_S} s)")
    for error in result.errors[:10]:
        print("  error:", error)
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=2) + "\n")
    return 0 if result.passed else 1


if __name__ == "__main__":
    sys.exit(main())
