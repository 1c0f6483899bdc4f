"""One log format, at the level asked for, for tailrace's loggers and uvicorn's alike."""

import re
import subprocess
import sys

STAMPED = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{3} (DEBUG|INFO|WARNING|ERROR|CRITICAL) [\w.]+: ")

_SCRIPT = """
import logging, sys
from tailrace.logs import configure_logging
configure_logging(sys.argv[1])
logging.getLogger("tailrace").info("tailrace info")
logging.getLogger("tailrace.engine").warning("engine warning")
logging.getLogger("uvicorn.error").error("uvicorn error")
"""


def log_lines(level: str) -> list[str]:
    run = subprocess.run([sys.executable, "-c", _SCRIPT, level], capture_output=True, text=True, timeout=60)
    return run.stderr.splitlines()


def test_every_line_has_a_timestamp_level_and_logger():
    lines = log_lines("info")
    assert len(lines) == 3
    assert all(STAMPED.match(line) for line in lines), lines


def test_the_level_governs_tailraces_own_logs():
    lines = log_lines("warning")
    assert [line.split(": ", 1)[1] for line in lines] == ["engine warning", "uvicorn error"]
