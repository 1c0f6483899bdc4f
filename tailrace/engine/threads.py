"""How many compute threads each CPU step gets, chosen by measuring steps as they run.

All cores are fastest while nothing else wants them, but the API process and a client on the
same cores turn OpenMP's barriers into waits for a descheduled thread: on 2 cores, 2 threads
measured 5-20x slower than 1 under that contention, and which is better changes with the load
from minute to minute. So the runner keeps, per kind of step (its token count, in powers of two),
a moving average of the step time under each candidate thread count, runs the best, and now and
then tries another. A candidate that keeps losing is tried exponentially less often (every
_EXPLORE_MIN to _EXPLORE_MAX steps), so a bad try costs a bounded share of the time even when
it is 20x slower.

The first step of a kind at a thread count is not measured: it pays one-time costs (oneDNN
creating its kernels for that count, the OpenMP team growing), which measured up to 1-7 s on the
SmolLM2-135M shape against 25 ms steps. Counted, it made that count lose its first try whatever
its speed, and pushed its next try twice as far away.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

import torch

_EXPLORE_MIN = 16
_EXPLORE_MAX = 512
_SMOOTHING = 0.3  # weight of the newest step in a moving average


def available_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def thread_candidates(cores: int) -> list[int]:
    """All cores first, then all but one (room for the API process), then half."""
    return sorted({cores, max(1, cores - 1), max(1, cores // 2)}, reverse=True)


@dataclass(slots=True)
class _Kind:
    """The measurements for one kind of step."""

    averages: dict[int, float] = field(default_factory=dict)  # threads -> seconds
    warmed: set[int] = field(default_factory=set)  # thread counts whose first step has run
    best: int = 0
    steps_to_explore: int = _EXPLORE_MIN
    interval: dict[int, int] = field(default_factory=dict)  # threads -> steps between its tries
    next_try: int = 0  # index into the candidates, round robin over the others


class ThreadTuner:
    """`start(tokens)` before a step sets the threads; `finish()` after it records the time.
    One candidate: the count stays fixed (an explicit --threads)."""

    def __init__(self, candidates: list[int]) -> None:
        self.candidates = candidates
        self._kinds: dict[int, _Kind] = {}
        self._running: tuple[_Kind, int, float] | None = None

    @property
    def fixed(self) -> bool:
        return len(self.candidates) == 1

    def start(self, num_tokens: int) -> int:
        kind = self._kinds.get(num_tokens.bit_length())
        if kind is None:
            kind = self._kinds[num_tokens.bit_length()] = _Kind(best=self.candidates[0])
        threads = self._choose(kind)
        if threads != torch.get_num_threads():
            torch.set_num_threads(threads)
        self._running = (kind, threads, time.perf_counter())
        return threads

    def finish(self) -> None:
        if self._running is None:
            return
        kind, threads, started = self._running
        self._running = None
        self.record(kind, threads, time.perf_counter() - started)

    def record(self, kind: _Kind, threads: int, seconds: float) -> None:
        if threads not in kind.warmed:
            kind.warmed.add(threads)  # a first step: not a measurement (see the module's docstring)
            return
        # The best's steps run back to back: smooth them. A try's measurement replaces the tried
        # count's average, which is stale by then (the load may have changed since).
        previous = kind.averages.get(threads)
        fresh = previous is None or threads != kind.best
        kind.averages[threads] = seconds if fresh else previous + _SMOOTHING * (seconds - previous)
        winner = min(kind.averages, key=kind.averages.__getitem__)
        if threads != kind.best:
            # A try: if it lost, try it half as often from now on; if it won, it becomes the best.
            step = kind.interval.get(threads, _EXPLORE_MIN)
            kind.interval[threads] = min(step * 2, _EXPLORE_MAX) if winner != threads else _EXPLORE_MIN
            kind.steps_to_explore = kind.interval[threads]
        kind.best = winner

    def _choose(self, kind: _Kind) -> int:
        if self.fixed:
            return self.candidates[0]
        untried = [t for t in self.candidates if t not in kind.averages]
        if untried and kind.best in kind.averages:
            return untried[0]
        kind.steps_to_explore -= 1
        if kind.steps_to_explore > 0:
            return kind.best
        others = [t for t in self.candidates if t != kind.best]
        kind.next_try = (kind.next_try + 1) % len(others)
        return others[kind.next_try]
