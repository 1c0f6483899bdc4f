"""One stream as long as the context allows: the API process's CPU per chunk, start vs end.

    .venv/bin/python bench/long_stream.py

Starts `tailrace serve` (embedded model), streams one completion of max_model_len - prompt tokens
(EOS ignored) and reads the API process's CPU time (/proc/PID/task/*/schedstat: HTTP, serving, JSON,
detokenizing; the engine core is a separate process and not counted) when the first, the 10%,
the 90% and the last chunk arrive. Flat per-chunk cost means nothing in the frontend grows with
the answer. Linux only.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

import httpx

from tailrace.bench.servers import ServerProcess, free_port, wait_ready


def cpu_seconds(pid: int) -> float:
    """CPU time of every thread of `pid`, in ns resolution (/proc/PID/stat counts 10 ms ticks)."""
    return sum(int((task / "schedstat").read_text().split()[0]) for task in Path(f"/proc/{pid}/task").iterdir()) / 1e9


def stream_marks(url: str, pid: int, max_tokens: int) -> tuple[int, list[tuple[int, float, float]]]:
    """(chunks, [(chunk index, API cpu s, wall s)]) read at every chunk."""
    marks = []
    body = {"model": "tiny", "prompt": "The list type", "max_tokens": max_tokens, "stream": True,
            "ignore_eos": True, "temperature": 0}
    chunks = 0
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=600) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                marks.append((chunks, cpu_seconds(pid), time.perf_counter()))
                chunks += 1
    return chunks, marks


def per_chunk_us(marks: list[tuple[int, float, float]], start: int, end: int) -> tuple[float, float]:
    (_, cpu0, wall0), (_, cpu1, wall1) = marks[start], marks[end]
    n = end - start
    return (cpu1 - cpu0) / n * 1e6, (wall1 - wall0) / n * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max-tokens", type=int, default=2040)
    parser.add_argument("--out", default="bench/out/long_stream.json")
    args = parser.parse_args()
    port = free_port()
    command = [sys.executable, "-m", "tailrace", "serve", "--port", str(port)]
    with tempfile.TemporaryDirectory() as tmp, \
            ServerProcess("tailrace", command, f"http://127.0.0.1:{port}", Path(tmp) / "server.log") as server:
        wait_ready([server], 120)
        chunks, marks = stream_marks(server.url, server.process.pid, args.max_tokens)
    tenth = len(marks) // 10
    first_cpu, first_wall = per_chunk_us(marks, 0, tenth)
    last_cpu, last_wall = per_chunk_us(marks, len(marks) - 1 - tenth, len(marks) - 1)
    print(f"\none stream of {chunks} chunks ({args.max_tokens} tokens asked), API process only")
    print(f"{'part':<12} {'API CPU us/chunk':>17} {'wall us/chunk':>14}")
    print(f"{'first 10%':<12} {first_cpu:>17.1f} {first_wall:>14.1f}")
    print(f"{'last 10%':<12} {last_cpu:>17.1f} {last_wall:>14.1f}")
    print(f"{'last/first':<12} {last_cpu / first_cpu:>16.2f}x {last_wall / first_wall:>13.2f}x")
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump({"date": datetime.now(timezone.utc).isoformat(), "chunks": chunks,
                   "api_cpu_us_per_chunk": [first_cpu, last_cpu], "wall_us_per_chunk": [first_wall, last_wall]},
                  f, indent=2)


if __name__ == "__main__":
    main()
