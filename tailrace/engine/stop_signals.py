"""The API process alone decides when the engine stops.

Supervisors signal a whole process group: systemd's default `KillMode=control-group`, `kill --
-PGID`, a terminal's Ctrl+C (SIGINT to the foreground group). If the engine core or a
tensor-parallel rank died of that signal, the streams the API process is draining would end with
an error. So they ignore every stop signal, and end when the API process tells them to (a
shutdown message, or SIGKILL after a grace period) or is gone (the core's pipe reads EOF; a rank's
broadcast from the core fails).

A child starts with the stop signals blocked (`blocked_while_starting`) and ignores them before it
unblocks them (`ignore_in_child`): one that arrives while the child is still importing waits,
and is then ignored, instead of killing it before it could say otherwise. The parent's own
handlers see a signal that arrives meanwhile once the block ends.
"""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Iterator

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)


@contextlib.contextmanager
def blocked_while_starting() -> Iterator[None]:
    """Around starting a child process: it inherits the stop signals blocked."""
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def ignore_in_child() -> None:
    """In the engine core and each rank, first thing: ignore the stop signals, then let them in."""
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)
