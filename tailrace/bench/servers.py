"""Server processes that a benchmark starts itself: launch, wait for /health, stop for sure.

Each server runs in its own session, so a Ctrl-C at the terminal reaches only the benchmark,
which then stops the servers in order (SIGTERM to the server's process group, SIGKILL after a grace
period) instead of leaving half-stopped engines behind.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from tailrace.bench.serve import BenchError

STOP_GRACE_S = 15.0
LOG_TAIL_CHARS = 3000


@dataclass(frozen=True, slots=True)
class Memory:
    """Bytes of a session's processes: resident (VmRSS) and its peak (VmHWM), each process's own
    summed, so pages two processes share count twice and the peaks need not have coincided; and
    proportional (Pss: a shared page split among its sharers), split into anonymous memory and
    file-backed pages (a mapped model file, shared libraries)."""
    rss: int = 0
    peak_rss: int = 0
    pss: int = 0
    pss_anon: int = 0
    pss_file: int = 0


def session_memory(session: int) -> Memory:
    """The Memory of the processes of a session (a server started in a session of its own, with
    the processes it starts, such as tailrace's engine core), from Linux's /proc; zeros where
    there is none."""
    total = dict.fromkeys(("VmRSS", "VmHWM", "Pss", "Pss_Anon", "Pss_File"), 0)
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            if int(stat.read_text().rsplit(")", 1)[1].split()[3]) != session:  # after the name: state ppid pgrp session
                continue
            lines = ((stat.parent / "status").read_text() + (stat.parent / "smaps_rollup").read_text()).splitlines()
        except (OSError, ValueError, IndexError):
            continue  # a process that ended meanwhile
        fields = dict(line.split(":", 1) for line in lines if ":" in line)
        for key in total:
            total[key] += int(fields.get(key, "0 kB").split()[0]) * 1024
    return Memory(total["VmRSS"], total["VmHWM"], total["Pss"], total["Pss_Anon"], total["Pss_File"])


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class ServerProcess:
    """A started server: its name, URL and log; use as a context manager so it is always stopped."""

    def __init__(self, name: str, command: list[str], url: str, log_path: Path,
                 env: dict[str, str] | None = None) -> None:
        self.name = name
        self.url = url
        self.log_path = log_path
        with open(log_path, "wb") as log:
            self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                            env=env, start_new_session=True)

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def log_tail(self) -> str:
        text = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
        return text[-LOG_TAIL_CHARS:]

    def memory(self) -> tuple[int, int]:
        """The memory of the server and its workers: see session_memory."""
        return session_memory(self.process.pid)

    def is_ready(self) -> bool:
        if self.process.poll() is not None:
            raise BenchError(f"{self.name} exited with {self.process.returncode} before it was ready:\n"
                             f"{self.log_tail()}")
        try:
            return httpx.get(self.url + "/health", timeout=2.0).status_code == 200
        except httpx.TransportError:
            return False  # not listening yet

    def stop(self) -> None:
        if self.process.poll() is not None:
            return
        self._signal(signal.SIGTERM)
        try:
            self.process.wait(STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            self._signal(signal.SIGKILL)
            self.process.wait()

    def _signal(self, signum: int) -> None:
        try:
            os.killpg(self.process.pid, signum)  # the group is the server and its children only
        except ProcessLookupError:
            pass  # it exited in the meantime


def wait_ready(servers: list[ServerProcess], timeout_s: float) -> None:
    """Until every server answers /health with 200; they load side by side."""
    deadline = time.monotonic() + timeout_s
    waiting = list(servers)
    while waiting:
        waiting = [server for server in waiting if not server.is_ready()]
        if waiting and time.monotonic() > deadline:
            names = ", ".join(server.name for server in waiting)
            raise BenchError(f"not ready within {timeout_s:.0f} s: {names}\n{waiting[0].log_tail()}")
        if waiting:
            time.sleep(0.5)
