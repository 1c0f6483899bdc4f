"""The engine's processes leave every stop signal to the API process (engine/stop_signals.py),
including one that arrives while they are still starting."""

from __future__ import annotations

import signal
import subprocess
import sys

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
