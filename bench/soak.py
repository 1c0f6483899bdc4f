"""Soak: a long run at fixed concurrency of mixed completions and chat, streamed and not, against
the embedded model. Passes with zero failed requests, resident memory (API process plus engine
core) grown less than 10% from the end of warm-up to the end, and p99 latency of the last window
within 1.5x of the second window's. Starts its own `tailrace serve` unless --url is given.

    .venv/bin/python bench/soak.py --duration 600 --concurrency 64 --json bench/out/soak.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from harness import API_KEY, MODEL, Server, ServerProcess, finish_reasons, percentile, read_stream, rss_bytes

MAX_RSS_GROWTH = 0.10
MAX_P99_RATIO = 1.5
RSS_SAMPLE_EVERY_S = 5.0
SUBJECTS = ("the river", "a stone bridge", "the old market", "winter bread", "the harbor at night",
            "a letter from home", "the mountain road", "summer music")


@dataclass(slots=True)
class Outcome:
    kind: str
    ended_at: float  # seconds since the soak started
    latency_s: float
    error: str | None


@dataclass
class Soak:
    outcomes: list[Outcome] = field(default_factory=list)
    rss: list[tuple[float, int]] = field(default_factory=list)  # (seconds since start, bytes)


def request_for(rng: random.Random, kind: str, max_tokens: int) -> tuple[str, dict]:
    subject = rng.choice(SUBJECTS)
    body = {"model": MODEL, "max_tokens": max_tokens, "temperature": 0.8, "stream": kind.endswith("stream")}
    if kind.startswith("chat"):
        return "/v1/chat/completions", {**body, "messages": [{"role": "user", "content": f"Tell me about {subject}."}]}
    return "/v1/completions", {**body, "prompt": f"A short story about {subject}:"}


async def send(client: httpx.AsyncClient, path: str, body: dict) -> str | None:
    """One request; what was wrong with its answer, or None."""
    if body["stream"]:
        chunks, problem = await read_stream(client, path, body)
        return problem or (None if finish_reasons(chunks) else "no finish_reason")
    try:
        response = await client.post(path, json=body)
    except httpx.HTTPError as err:
        return f"{type(err).__name__}: {err}"
    if response.status_code != 200:
        return f"status {response.status_code}: {response.text[:200]}"
    return None if all(c["finish_reason"] for c in response.json()["choices"]) else "no finish_reason"


async def worker(client: httpx.AsyncClient, rng: random.Random, soak: Soak, started: float, until: float,
                 max_tokens: int) -> None:
    kinds = ("completion", "completion-stream", "chat", "chat-stream")
    while time.monotonic() < until:
        kind = rng.choice(kinds)
        path, body = request_for(rng, kind, max_tokens)
        sent = time.monotonic()
        error = await send(client, path, body)
        now = time.monotonic()
        soak.outcomes.append(Outcome(kind, now - started, now - sent, error))


async def sample_rss(pids: list[int], soak: Soak, started: float, until: float) -> None:
    while time.monotonic() < until:
        soak.rss.append((time.monotonic() - started, sum(rss_bytes(pid) for pid in pids)))
        await asyncio.sleep(RSS_SAMPLE_EVERY_S)


async def run(server: Server, pids: list[int], duration_s: float, concurrency: int, max_tokens: int,
              seed: int) -> Soak:
    soak = Soak()
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)
    async with httpx.AsyncClient(base_url=server.url, headers=server.headers, timeout=120, limits=limits) as client:
        started = time.monotonic()
        until = started + duration_s
        workers = [worker(client, random.Random(seed * 1000 + i), soak, started, until, max_tokens)
                   for i in range(concurrency)]
        samplers = [sample_rss(pids, soak, started, until)] if pids else []
        await asyncio.gather(*workers, *samplers)
    return soak


def summarize(soak: Soak, duration_s: float, warmup_s: float, window_s: float) -> dict:
    windows = []
    for start in range(0, int(duration_s), int(window_s)):
        latencies = [o.latency_s for o in soak.outcomes if start <= o.ended_at < start + window_s]
        windows.append({"from_s": start, "requests": len(latencies),
                        "p50_s": round(percentile(latencies, 50), 3), "p99_s": round(percentile(latencies, 99), 3)})
    failures = [o for o in soak.outcomes if o.error is not None]
    after_warmup = [bytes_ for at, bytes_ in soak.rss if at >= warmup_s]
    rss_growth = (after_warmup[-1] - after_warmup[0]) / after_warmup[0] if len(after_warmup) > 1 else None
    p99_ratio = windows[-1]["p99_s"] / windows[1]["p99_s"] if len(windows) > 2 else None
    figures = {
        "requests": len(soak.outcomes), "failed": len(failures),
        "failures": [f"{o.kind} at {o.ended_at:.1f} s: {o.error}" for o in failures[:20]],
        "requests_per_s": round(len(soak.outcomes) / duration_s, 2),
        "latency_all": {f"p{q}_s": round(percentile([o.latency_s for o in soak.outcomes], q), 3) for q in (50, 90, 99)},
        "windows": windows, "p99_last_over_second": None if p99_ratio is None else round(p99_ratio, 3),
        "rss_mb_after_warmup": round(after_warmup[0] / 2**20, 1) if after_warmup else None,
        "rss_mb_end": round(after_warmup[-1] / 2**20, 1) if after_warmup else None,
        "rss_mb_max": round(max(after_warmup) / 2**20, 1) if after_warmup else None,
        "rss_growth": None if rss_growth is None else round(rss_growth, 4),
    }
    figures["passed"] = (not failures and (rss_growth is None or rss_growth < MAX_RSS_GROWTH)
                         and (p99_ratio is None or p99_ratio <= MAX_P99_RATIO))
    return figures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration", type=float, default=600.0, help="seconds of load")
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--warmup", type=float, default=60.0, help="memory growth is measured from here")
    parser.add_argument("--window", type=float, default=60.0, help="latency percentiles per window of this many s")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--url", help="an already running server (default: start one; memory is then not measured)")
    parser.add_argument("--api-key", default=API_KEY)
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args(argv)

    def soak_on(server: Server, pids: list[int]) -> Soak:
        return asyncio.run(run(server, pids, args.duration, args.concurrency, args.max_tokens, args.seed))

    if args.url:
        soak = soak_on(Server(args.url, args.api_key), [])
    else:
        with ServerProcess(Path(tempfile.mkdtemp()) / "server.log") as server:
            server.wait_healthy()
            soak = soak_on(server, [server.pid, server.core_pid()])
    figures = {**summarize(soak, args.duration, args.warmup, args.window), "command": " ".join(sys.argv)}
    print(f"{figures['requests']} requests ({figures['requests_per_s']}/s), {figures['failed']} failed; "
          f"latency p50 {figures['latency_all']['p50_s']} s, p99 {figures['latency_all']['p99_s']} s; "
          f"p99 last/second window {figures['p99_last_over_second']}; RSS {figures['rss_mb_after_warmup']} -> "
          f"{figures['rss_mb_end']} MiB (growth {figures['rss_growth']}); passed: {figures['passed']}")
    for window in figures["windows"]:
        print(f"  {window['from_s']:>5} s: {window['requests']:>6} requests, p50 {window['p50_s']} s, "
              f"p99 {window['p99_s']} s")
    for failure in figures["failures"]:
        print("  failed:", failure)
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=2) + "\n")
    return 0 if figures["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
