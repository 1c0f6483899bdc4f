"""One format for every log line the server writes: tailrace's own, uvicorn's (startup, access log)
and the engine core process's. uvicorn's loggers keep no handler of their own here; their records
reach the one handler on the root logger."""

from __future__ import annotations

import contextlib
import logging
import sys
import time
from collections.abc import Iterator

LOG_FORMAT = "%(asctime)s.%(msecs)03d %(levelname)s %(name)s: %(message)s"
DATE_FORMAT = "%Y-%m-%d %H:%M:%S"
LOG_LEVELS = ("critical", "error", "warning", "info", "debug")
UVICORN_LOG_LEVELS = (*LOG_LEVELS, "trace")  # uvicorn's own extra level, below debug


@contextlib.contextmanager
def timed(log: logging.Logger, phase: str) -> Iterator[None]:
    """Logs at debug how long `phase` took: where a start-up's seconds go (--log-level debug)."""
    start = time.perf_counter()
    yield
    log.debug("%s took %.2f s", phase, time.perf_counter() - start)


def configure_logging(level: str | int) -> None:
    """Log to stderr at `level` ("info", or a logging level number). A root handler already there
    (pytest's) is kept."""
    if isinstance(level, str):
        level = logging.getLevelName(level.upper())
    logging.basicConfig(format=LOG_FORMAT, datefmt=DATE_FORMAT, stream=sys.stderr)
    logging.getLogger().setLevel(level)
