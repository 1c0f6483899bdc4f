"""A real server process through its end: a graceful stop on SIGTERM or SIGINT, sent to the server
alone or to its whole process group as supervisors and terminals send them, and exit 1 (for a
supervisor to restart it) when its engine core, or one of its tensor-parallel ranks, dies, with no
open stream left hanging and no engine process left running either way."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from harness import MODEL, ServerProcess, alive

from .conftest import start_server

STREAM = {"model": MODEL, "prompt": "Once upon a time", "ignore_eos": True, "stream": True}
PROMPT_ERROR_S = 2.0  # an open stream ends this soon after the core dies
EXIT_WITHIN_S = 20.0
ORPHAN_S = 5.0  # the engine's processes outlive a killed server by at most this


@contextlib.contextmanager
def open_stream(server: ServerProcess, max_tokens: int) -> Iterator[Iterator[str]]:
    """A completion stream whose first event has arrived: its remaining lines."""
    with httpx.Client(base_url=server.url, headers=server.headers, timeout=60) as client:
        with client.stream("POST", "/v1/completions", json={**STREAM, "max_tokens": max_tokens}) as response:
            lines = response.iter_lines()
            assert next(lines).startswith("data: {")
            yield lines


def health_status(server: ServerProcess, within_s: float) -> int | None:
    """/health's status once it is no longer 200 (a load balancer's view of a draining server)."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        status = httpx.get(server.url + "/health", timeout=1.0).status_code
        if status != 200:
            return status
        time.sleep(0.05)
    return None


def drains_completely(server: ServerProcess, lines: Iterator[str], max_tokens: int, signalled_at: float) -> None:
    """The open stream finishes with all its tokens and no error, and the server exits 0."""
    events = [line.removeprefix("data: ") for line in lines if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert not any("error" in c for c in chunks), chunks[-2:]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert len(chunks) >= max_tokens - 1  # the first event was read before the signal
    finished = time.monotonic()
    assert server.wait(EXIT_WITHIN_S) == 0, server.log_tail()
    print(f"stream finished {finished - signalled_at:.2f} s after the signal, "
          f"exit 0 after {time.monotonic() - signalled_at:.2f} s")


@pytest.mark.parametrize(("sig", "group"), [(signal.SIGTERM, False), (signal.SIGINT, False), (signal.SIGINT, True),
                                            (signal.SIGTERM, True)],
                         ids=["SIGTERM", "SIGINT", "SIGINT-to-the-group (Ctrl+C in a terminal)",
                              "SIGTERM-to-the-group (systemd's KillMode=control-group)"])
def test_signal_drains_with_health_503_lets_the_open_stream_finish_and_exits_0(tmp_path_factory, sig, group):
    server = start_server(tmp_path_factory, f"shutdown-{sig.name}", "--graceful-shutdown-timeout", "60")
    with server, open_stream(server, max_tokens=300) as lines:
        server.send_signal(sig, group=group)
        signalled_at = time.monotonic()
        assert health_status(server, within_s=5.0) == 503
        drains_completely(server, lines, 300, signalled_at)


def test_bin_serve_drains_on_sigterm_to_its_group(tmp_path_factory):
    """bin/serve execs the server, so in a container it is PID 1 and gets the runtime's SIGTERM."""
    server = start_server(tmp_path_factory, "bin-serve", "--graceful-shutdown-timeout", "60", via_bin_serve=True)
    with server, open_stream(server, max_tokens=300) as lines:
        command = Path(f"/proc/{server.pid}/cmdline").read_bytes().split(b"\0")
        assert command[1].endswith(b"/bin/tailrace") and command[2] == b"serve"  # bin/serve became the server
        server.send_signal(signal.SIGTERM, group=True)
        drains_completely(server, lines, 300, time.monotonic())


@pytest.mark.slow
def test_streams_past_the_graceful_timeout_are_cut_and_the_exit_is_still_0(tmp_path_factory):
    server = start_server(tmp_path_factory, "shutdown-timeout", "--graceful-shutdown-timeout", "1")
    with server, open_stream(server, max_tokens=1500) as lines:
        stopped_at = time.monotonic()
        server.send_signal(signal.SIGTERM)
        with pytest.raises(httpx.RemoteProtocolError):  # cut: the chunked body never completes
            for _ in lines:
                pass
        assert server.wait(EXIT_WITHIN_S) == 0, server.log_tail()
        assert time.monotonic() - stopped_at < 1.0 + EXIT_WITHIN_S / 2


@pytest.mark.parametrize("victim", ["engine core", "tensor-parallel rank 1"])
def test_engine_death_ends_open_streams_with_an_error_and_exits_1(tmp_path_factory, victim):
    flags = ("--tensor-parallel-size", "2") if victim.startswith("tensor") else ()
    server = start_server(tmp_path_factory, "engine-death", *flags)
    with server, open_stream(server, max_tokens=1500) as lines:
        processes = [server.core_pid(), *server.rank_pids()]
        os.kill(processes[0] if victim == "engine core" else processes[1], signal.SIGKILL)
        killed_at = time.monotonic()
        events = [line.removeprefix("data: ") for line in lines if line.startswith("data: ")]
        ended_after = time.monotonic() - killed_at
        assert events[-1] == "[DONE]"
        error = json.loads(events[-2])["error"]
        assert (error["type"], error["code"]) == ("server_error", "engine_unavailable")
        assert ended_after < PROMPT_ERROR_S
        try:  # until the process is gone, the server says it is unhealthy
            health = httpx.get(server.url + "/health", timeout=2.0).status_code
            assert health == 503
        except httpx.TransportError:
            # Gone, or going: a connection the kernel accepted just before the server closed its
            # listening socket is reset (ReadError), one made after it is refused (ConnectError).
            pass
        assert server.wait(EXIT_WITHIN_S) == 1, server.log_tail()
        if victim.startswith("tensor"):  # the log names the rank, not only the collective's socket error
            assert "tensor-parallel rank 1 exited with status -9" in server.log_tail()
        print(f"{victim} killed: stream error after {ended_after * 1000:.0f} ms, "
              f"server exit 1 after {time.monotonic() - killed_at:.2f} s")
    assert not [pid for pid in processes if alive(pid)]


@pytest.mark.parametrize("group", [False, True], ids=["to the server", "to the group"])
def test_sigterm_with_two_ranks_lets_the_open_stream_finish_and_ends_every_rank(tmp_path_factory, group):
    server = start_server(tmp_path_factory, "tp-shutdown", "--tensor-parallel-size", "2",
                          "--graceful-shutdown-timeout", "60")
    with server, open_stream(server, max_tokens=100) as lines:
        processes = [server.core_pid(), *server.rank_pids()]
        assert len(processes) == 2
        server.send_signal(signal.SIGTERM, group=group)
        drains_completely(server, lines, 100, time.monotonic())
    assert not [pid for pid in processes if alive(pid)]


def test_a_killed_server_leaves_no_engine_core_or_rank_running(tmp_path_factory):
    server = start_server(tmp_path_factory, "server-killed", "--tensor-parallel-size", "2")
    with server, open_stream(server, max_tokens=1500):
        processes = [server.core_pid(), *server.rank_pids()]
        assert len(processes) == 2
        server.send_signal(signal.SIGKILL)
        killed_at = time.monotonic()
        while [pid for pid in processes if alive(pid)] and time.monotonic() - killed_at < ORPHAN_S:
            time.sleep(0.05)
        assert not [pid for pid in processes if alive(pid)], server.log_tail()
        print(f"engine core and rank gone {time.monotonic() - killed_at:.2f} s after the server was killed")


def test_a_second_sigint_stops_at_once_without_a_traceback(tmp_path_factory):
    server = start_server(tmp_path_factory, "forced-stop", "--graceful-shutdown-timeout", "60")
    with server, open_stream(server, max_tokens=1500):
        server.send_signal(signal.SIGINT)
        assert health_status(server, within_s=5.0) == 503
        server.send_signal(signal.SIGINT)
        assert server.wait(EXIT_WITHIN_S) == 0
    assert "Traceback" not in server.log_tail()


def test_a_busy_port_prints_one_line_and_exits_1():
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        done = subprocess.run([sys.executable, "-m", "tailrace", "serve", "--port", str(port)], capture_output=True,
                              text=True, timeout=EXIT_WITHIN_S)
    errors = [line for line in (done.stdout + done.stderr).splitlines() if "ERROR" in line or "Traceback" in line]
    assert done.returncode == 1
    assert len(errors) == 1 and f"cannot listen on 127.0.0.1:{port}: Address already in use" in errors[0]
