"""A real `tailrace serve` process for the reliability tests and the soak scripts: start it, wait for
/health, read its gauges and memory, signal it, and get its exit code.

Used by bench/soak.py and bench/disconnect_storm.py, and by tests/reliability (which put this
directory on sys.path), so the scripts' figures and the CI checks measure the same way.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
API_KEY = "reliability-key"
MODEL = "tiny"
LOG_TAIL_CHARS = 6000
RUNNING = "tailrace:num_requests_running"
WAITING = "tailrace:num_requests_waiting"
KV_USAGE = "tailrace:kv_cache_usage_perc"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Server:
    """A running server, reached over HTTP with its key."""

    def __init__(self, url: str, api_key: str = API_KEY) -> None:
        self.url = url.rstrip("/")
        self.headers = {"Authorization": f"Bearer {api_key}"}

    def gauges(self, client: httpx.Client | None = None) -> dict[str, float]:
        """Every sample of /metrics, by name (labels dropped: one model, one value each)."""
        get = client.get if client is not None else httpx.get
        return parse_metrics(get(self.url + "/metrics", headers=self.headers, timeout=10.0).text)

    def wait_idle(self, idle_kv: float, timeout_s: float) -> float | None:
        """Seconds until no request runs or waits and KV usage is back at `idle_kv`; None if not within timeout_s."""
        started = time.monotonic()
        with httpx.Client(timeout=5.0) as client:
            while time.monotonic() - started < timeout_s:
                g = self.gauges(client)
                if g[RUNNING] == 0 and g[WAITING] == 0 and g[KV_USAGE] == idle_kv:
                    return time.monotonic() - started
                time.sleep(0.02)
        return None


class ServerProcess(Server):
    """`tailrace serve` on a free loopback port with an API key; a context manager that always stops it."""

    def __init__(self, log_path: Path, *flags: str, model: str | None = None, via_bin_serve: bool = False) -> None:
        """via_bin_serve: started as the README says (bin/serve, which sets up and then execs the
        server, so the server is the process started here)."""
        self.port = free_port()
        super().__init__(f"http://127.0.0.1:{self.port}")
        self.log_path = log_path
        launcher = [str(REPO / "bin" / "serve")] if via_bin_serve else [sys.executable, "-m", "tailrace", "serve"]
        command = [*launcher, *([model] if model else []), "--port", str(self.port),
                   "--api-key", API_KEY, "--served-model-name", MODEL, *flags]
        with open(log_path, "wb") as log:
            # Its own process group, so a test can signal the group as a terminal's Ctrl+C does.
            self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                            cwd=REPO, start_new_session=True)

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    @property
    def pid(self) -> int:
        return self.process.pid

    def log_tail(self) -> str:
        text = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
        return text[-LOG_TAIL_CHARS:]

    def wait_healthy(self, timeout_s: float = 120.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"the server exited with {self.process.returncode}:\n{self.log_tail()}")
            try:
                if httpx.get(self.url + "/health", timeout=1.0).status_code == 200:
                    return
            except httpx.TransportError:
                pass  # not listening yet
            time.sleep(0.1)
        raise RuntimeError(f"/health was not 200 within {timeout_s:.0f} s:\n{self.log_tail()}")

    def core_pid(self) -> int:
        """The engine core: the server's child process that is not multiprocessing's resource tracker."""
        for child in _children(self.pid):
            if b"resource_tracker" not in Path(f"/proc/{child}/cmdline").read_bytes():
                return child
        raise RuntimeError("the server has no engine core process")

    def rank_pids(self) -> list[int]:
        """The tensor-parallel workers (ranks 1..N-1): the engine core's child processes."""
        return _children(self.core_pid())

    def send_signal(self, sig: signal.Signals, group: bool = False) -> None:
        """To the server process, or with group=True to its whole process group (engine core included)."""
        if group:
            os.killpg(self.process.pid, sig)
        else:
            self.process.send_signal(sig)

    def wait(self, timeout_s: float) -> int:
        return self.process.wait(timeout_s)

    def stop(self, grace_s: float = 15.0) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(grace_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        return self.process.returncode


def parse_metrics(text: str) -> dict[str, float]:
    samples = re.finditer(r"^([^#\s{]+)(?:\{[^}]*\})? (\S+)$", text, re.MULTILINE)
    return {m.group(1): float(m.group(2)) for m in samples}


def _children(pid: int) -> list[int]:
    children: list[int] = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        children += [int(c) for c in (task / "children").read_text().split()]
    return children


def alive(pid: int) -> bool:
    """Whether the process exists and has not exited (a zombie waiting to be reaped has)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


def rss_bytes(pid: int) -> int:
    """Resident memory of one process (VmRSS), in bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for process {pid}")


async def read_stream(client: httpx.AsyncClient, path: str, body: dict) -> tuple[list[dict], str | None]:
    """The chunks of one SSE stream, and what was wrong with it (a status, a transport error, no
    [DONE] at the end, an in-band error), or None."""
    try:
        async with client.stream("POST", path, json=body) as response:
            if response.status_code != 200:
                return [], f"status {response.status_code}: {(await response.aread())[:200]!r}"
            events = [line[6:] async for line in response.aiter_lines() if line.startswith("data: ")]
    except httpx.HTTPError as err:
        return [], f"{type(err).__name__}: {err}"
    if not events or events[-1] != "[DONE]":
        return [], "no [DONE] at the end"
    chunks = [json.loads(e) for e in events[:-1]]
    errors = [c for c in chunks if "error" in c]
    return chunks, f"in-band error {errors[0]}" if errors else None


def finish_reasons(chunks: list[dict]) -> list[str]:
    return [p["finish_reason"] for c in chunks for p in c["choices"] if p["finish_reason"]]


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0-100) by linear interpolation; NaN for no values."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low = int(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)

