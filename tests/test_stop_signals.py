"""The engine's processes leave every stop signal to the API process (engine/stop_signals.py),
including one that arrives while they are still starting."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

from tailrace.engine.stop_signals import STOP_SIGNALS, blocked_while_starting

# Slow to reach ignore_in_child, as the engine core is while it imports torch.
CHILD = ("import time; time.sleep(1.0); from tailrace.engine.stop_signals import ignore_in_child; ignore_in_child(); "
         "print('ignoring', flush=True); time.sleep(0.5); print('done', flush=True)")


def test_a_child_survives_stop_signals_sent_before_and_after_it_ignores_them():
    with blocked_while_starting():
        child = subprocess.Popen([sys.executable, "-c", CHILD], stdout=subprocess.PIPE, text=True)
    for sig in STOP_SIGNALS:  # while it sleeps, before it has said anything: blocked, then ignored
        child.send_signal(sig)
    assert child.stdout.readline() == "ignoring\n"
    for sig in STOP_SIGNALS:
        child.send_signal(sig)
    assert child.stdout.readline() == "done\n"
    assert child.wait(10) == 0


def test_without_the_block_a_starting_child_dies_of_sigterm():
    """The same child started plainly: what the block prevents."""
    child = subprocess.Popen([sys.executable, "-c", CHILD], stdout=subprocess.PIPE, text=True)
    child.send_signal(signal.SIGTERM)
    assert child.wait(10) == -signal.SIGTERM


def test_the_parent_gets_its_own_signal_mask_back():
    before = signal.pthread_sigmask(signal.SIG_BLOCK, [])
    with blocked_while_starting():
        assert set(STOP_SIGNALS) <= signal.pthread_sigmask(signal.SIG_BLOCK, [])
    assert signal.pthread_sigmask(signal.SIG_BLOCK, []) == before


def test_an_api_process_that_exits_without_stopping_the_engine_still_exits_and_takes_the_core():
    """The core ignores SIGTERM, which multiprocessing's exit handler sends its daemon children
    before it waits for them: start_core makes sure that wait is not for ever."""
    code = ("import asyncio\nfrom tailrace.engine.client import EngineClient\nfrom tailrace.engine.config import "
            "EngineConfig\nKEPT = []  # the pipe stays open to the end: the core never reads EOF\n"
            "async def main():\n    KEPT.append(await EngineClient.start(EngineConfig(num_kv_blocks=16)))\n"
            "    print(KEPT[0]._worker.pid, flush=True)\nasyncio.run(main())\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    core = int(done.stdout.split()[-1])
    deadline = time.monotonic() + 5
    while _alive(core) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(core)


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except FileNotFoundError:
        return False
    return state not in ("Z", "X")
