"""Running the app under uvicorn: a graceful stop on SIGTERM or SIGINT (exit 0), and exit 1 when the
engine core dies, so that a supervisor (systemd, Kubernetes, docker --restart) starts a fresh server.

A graceful stop drains first: the server keeps listening, /health answers 503 so that load balancers
take it out of rotation, new generation requests answer 503 (clients retry elsewhere), and the
running ones finish, up to `timeout_graceful_shutdown`. Then uvicorn closes the socket and stops.

Restarting the core in place was the alternative; exiting is simpler and leaves no half-state. From
the moment the core dies, /health and new requests answer 503 until the listening socket closes, and
every open stream ends with an in-band error before the process exits.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import signal
import socket
from collections.abc import Callable, Iterator
from types import FrameType

import uvicorn

from tailrace.api.app import start_draining
from tailrace.engine.client import EngineClient, EngineDeadError
from tailrace.heap import freeze_startup_objects

log = logging.getLogger("tailrace")

_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class GracefulServer(uvicorn.Server):
    """uvicorn re-raises a caught SIGTERM/SIGINT once it has shut down, which would turn a graceful
    stop into death by that signal (exit 143 or 130). Here the first signal only starts the drain;
    when no request is left running (or the drain's time is up) uvicorn's own shutdown follows. A
    second SIGINT forces the exit at once, as in uvicorn."""

    drain_deadline: float | None = None  # loop time; set by the first signal

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        loop = asyncio.get_running_loop()
        if self.drain_deadline is None:
            timeout = self.config.timeout_graceful_shutdown
            self.drain_deadline = loop.time() + (math.inf if timeout is None else timeout)
            start_draining(self.config.app)
            log.info("draining: /health answers 503 while running requests finish (Ctrl+C again to stop at once)")
        elif sig == signal.SIGINT:
            self.should_exit = self.force_exit = True

    async def on_tick(self, counter: int) -> bool:
        if self.drain_deadline is not None and not self.should_exit:
            left = self.drain_deadline - asyncio.get_running_loop().time()
            if not self.server_state.tasks or left <= 0:
                # uvicorn's shutdown waits for what is still running: only the drain's time left.
                self.config.timeout_graceful_shutdown = None if math.isinf(left) else max(left, 0.0)
                self.should_exit = True
        return await super().on_tick(counter)

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        await super().shutdown(sockets)
        if self.force_exit:  # uvicorn skips the app's shutdown then; its lifespan task would die with a traceback
            await self.lifespan.shutdown()

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


async def run_server(config: uvicorn.Config, sock: socket.socket, engine: EngineClient,
                     on_ready: Callable[[], None]) -> int:
    """Serve on `sock` (see listen) until a signal stops the server (0), or the engine cannot start
    or dies (1).

    The server listens while the model loads (/health answers 503 until it is ready).
    """
    server = GracefulServer(config)
    serving = asyncio.create_task(server.serve(sockets=[sock]))
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
    freeze_startup_objects()
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


def listen(host: str, port: int, backlog: int = 2048) -> socket.socket:
    """The listening socket, made before the model loads so the port is ours (and /health answers),
    or OSError: a taken port is then one line from the caller, not uvicorn's exit from inside a task.

    Its protocol is named (IPPROTO_TCP, not 0): asyncio turns Nagle off on an accepted connection
    only when the socket says it is TCP. With Nagle on, a response written in two parts (headers,
    then body) waits for the client's delayed ACK, 40 ms per request on a kept-alive connection.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(backlog)
    except OSError:
        sock.close()
        raise
    return sock


async def _stop(server: uvicorn.Server, serving: asyncio.Task, engine: EngineClient, code: int) -> int:
    server.should_exit = True
    await serving
    await engine.shutdown()
    return code
