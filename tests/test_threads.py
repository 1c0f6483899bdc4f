"""The per-step choice of compute threads, by measured step time."""

from __future__ import annotations

import pytest
import torch

from tailrace.engine.threads import ThreadTuner, thread_candidates


@pytest.fixture(autouse=True)
def _restore_threads():
    previous = torch.get_num_threads()
    yield
    torch.set_num_threads(previous)


def test_candidates_are_all_cores_all_but_one_and_half():
    assert thread_candidates(2) == [2, 1]
    assert thread_candidates(1) == [1]
    assert thread_candidates(16) == [16, 15, 8]


def _run(tuner: ThreadTuner, cost: dict[int, float], steps: int, tokens: int = 8,
         first_cost: float | None = None) -> list[int]:
    """Steps whose time depends only on the threads they got (first_cost: the time of the first step
    at each count, one-time costs included); returns the thread count of each."""
    used = []
    for _ in range(steps):
        threads = tuner.start(tokens)
        kind = tuner._running[0]
        tuner._running = None
        first = first_cost is not None and threads not in used
        tuner.record(kind, threads, first_cost if first else cost[threads])
        used.append(threads)
    return used


def test_settles_on_the_faster_count_and_keeps_trying_the_other_ever_less_often():
    used = _run(ThreadTuner([2, 1]), {2: 1.0, 1: 3.0}, 2000)
    assert used[:4] == [2, 2, 1, 1]  # each count's first step is not measured
    tries = [i for i, t in enumerate(used) if t == 1]
    assert 3 <= len(tries) <= 12  # intervals 16, 32, ..., 512
    gaps = [b - a for a, b in zip(tries, tries[1:])]
    assert gaps == sorted(gaps) and gaps[-1] <= 513


def test_switches_when_the_load_makes_the_current_count_slow():
    tuner = ThreadTuner([2, 1])
    _run(tuner, {2: 1.0, 1: 2.0}, 100)
    used = _run(tuner, {2: 20.0, 1: 2.0}, 50)  # contention: 2 threads collapse
    assert used[-40:].count(1) >= 38
    used = _run(tuner, {2: 1.0, 1: 2.0}, 200)  # it passes
    assert used[-100:].count(2) >= 95


def test_each_kind_of_step_is_measured_on_its_own():
    tuner = ThreadTuner([2, 1])
    _run(tuner, {2: 1.0, 1: 2.0}, 50, tokens=1)
    _run(tuner, {2: 5.0, 1: 2.0}, 50, tokens=512)
    assert _run(tuner, {2: 1.0, 1: 2.0}, 10, tokens=1).count(2) >= 9
    assert _run(tuner, {2: 5.0, 1: 2.0}, 10, tokens=512).count(1) >= 9


@pytest.mark.parametrize("cost", [{2: 1.4, 1: 1.0}, {2: 1.0, 1: 1.4}])
def test_the_first_step_at_a_count_which_pays_one_time_costs_does_not_decide(cost):
    """oneDNN creates its kernels for a thread count on the first step that runs at it: 70 ms to 7 s
    on the SmolLM2-135M shape against 25 ms steps."""
    used = _run(ThreadTuner([2, 1]), cost, 40, first_cost=100.0)
    faster = min(cost, key=cost.__getitem__)
    assert used[4:].count(faster) >= 35


def test_a_single_candidate_stays_fixed():
    tuner = ThreadTuner([1])
    assert tuner.fixed
    assert _run(tuner, {1: 1.0}, 20) == [1] * 20
