"""Running the app under uvicorn: a graceful stop on SIGTERM or SIGINT (exit 0), and exit 1 when the
engine core dies, so that a supervisor (systemd, Kubernetes, docker --restart) starts a fresh server.

Restarting the core in place was the alternative; exiting is simpler and leaves no half-state. From
the moment the core dies, /health and new requests answer 503 until the listening socket closes, and
every open stream ends with an in-band error before the process exits.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from collections.abc import Callable, Iterator

import uvicorn

from tailrace.engine.client import EngineClient, EngineDeadError

log = logging.getLogger("tailrace")

_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class GracefulServer(uvicorn.Server):
    """uvicorn re-raises a caught SIGTERM/SIGINT once it has shut down, which would turn a graceful
    stop into death by that signal (exit 143 or 130). Here a signal only starts the graceful
    shutdown: stop accepting, let running responses finish up to `timeout_graceful_shutdown`. A
    second SIGINT still forces the exit (uvicorn's `handle_exit`)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        loop = asyncio.get_running_loop()
        for sig in _STOP_SIGNALS:
            loop.add_signal_handler(sig, self.handle_exit, sig, None)
        try:
            yield
        finally:
            for sig in _STOP_SIGNALS:
                loop.remove_signal_handler(sig)


async def run_server(config: uvicorn.Config, engine: EngineClient, on_ready: Callable[[], None]) -> int:
    """Serve until a signal stops the server (0) or the engine cannot start or dies (1).

    The server listens while the model loads (/health answers 503 until it is ready).
    """
    server = GracefulServer(config)
    serving = asyncio.create_task(server.serve())
    launch = asyncio.create_task(engine.launch())
    await asyncio.wait({serving, launch}, return_when=asyncio.FIRST_COMPLETED)
    if not launch.done():  # stopped while the model was loading
        launch.cancel()
        await engine.shutdown()
        return 0
    try:
        launch.result()
    except EngineDeadError as exc:
        log.error("%s", exc)
        return await _stop(server, serving, engine, code=1)
    on_ready()
    died = asyncio.create_task(engine.wait_dead())
    await asyncio.wait({serving, died}, return_when=asyncio.FIRST_COMPLETED)
    if serving.done():
        died.cancel()
        await engine.shutdown()
        return 0
    log.error("the engine core died (%s); open requests got an error, the server exits so that a "
              "supervisor can restart it", died.result())
    return await _stop(server, serving, engine, code=1)


async def _stop(server: uvicorn.Server, serving: asyncio.Task, engine: EngineClient, code: int) -> int:
    server.should_exit = True
    await serving
    await engine.shutdown()
    return code
