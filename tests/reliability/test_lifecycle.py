"""A real server process through its end: a graceful stop on SIGTERM or SIGINT, and exit 1 (for a
supervisor to restart it) when its engine core dies, with no open stream left hanging either way."""

from __future__ import annotations

import json
import os
import signal
import time

import httpx
import pytest

from harness import MODEL, ServerProcess

from .conftest import start_server

STREAM = {"model": MODEL, "prompt": "Once upon a time", "ignore_eos": True, "stream": True}
PROMPT_ERROR_S = 2.0  # an open stream ends this soon after the core dies
EXIT_WITHIN_S = 20.0


def refuses_connections(server: ServerProcess, within_s: float) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            httpx.get(server.url + "/health", timeout=1.0)
        except httpx.ConnectError:
            return True
        time.sleep(0.05)
    return False


@pytest.mark.parametrize(("sig", "group"), [(signal.SIGTERM, False), (signal.SIGINT, False), (signal.SIGINT, True)],
                         ids=["SIGTERM", "SIGINT", "SIGINT-to-the-group (Ctrl+C in a terminal)"])
def test_signal_lets_the_open_stream_finish_refuses_new_connections_and_exits_0(tmp_path_factory, sig, group):
    server = start_server(tmp_path_factory, f"shutdown-{sig.name}", "--graceful-shutdown-timeout", "60")
    with server, httpx.Client(base_url=server.url, headers=server.headers, timeout=60) as client:
        with client.stream("POST", "/v1/completions", json={**STREAM, "max_tokens": 300}) as response:
            lines = response.iter_lines()
            assert next(lines).startswith("data: {")
            server.send_signal(sig, group=group)
            assert refuses_connections(server, within_s=5.0), "still accepting connections after the signal"
            events = [line.removeprefix("data: ") for line in lines if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        assert not any("error" in c for c in chunks)
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        assert server.wait(EXIT_WITHIN_S) == 0, server.log_tail()


@pytest.mark.slow
def test_streams_past_the_graceful_timeout_are_cut_and_the_exit_is_still_0(tmp_path_factory):
    server = start_server(tmp_path_factory, "shutdown-timeout", "--graceful-shutdown-timeout", "1")
    with server, httpx.Client(base_url=server.url, headers=server.headers, timeout=60) as client:
        with client.stream("POST", "/v1/completions", json={**STREAM, "max_tokens": 1500}) as response:
            lines = response.iter_lines()
            assert next(lines).startswith("data: {")
            stopped_at = time.monotonic()
            server.send_signal(signal.SIGTERM)
            with pytest.raises(httpx.RemoteProtocolError):  # cut: the chunked body never completes
                for _ in lines:
                    pass
        assert server.wait(EXIT_WITHIN_S) == 0, server.log_tail()
        assert time.monotonic() - stopped_at < 1.0 + EXIT_WITHIN_S / 2


def test_engine_death_ends_open_streams_with_an_error_and_exits_1(tmp_path_factory):
    server = start_server(tmp_path_factory, "engine-death")
    with server, httpx.Client(base_url=server.url, headers=server.headers, timeout=60) as client:
        with client.stream("POST", "/v1/completions", json={**STREAM, "max_tokens": 1500}) as response:
            lines = response.iter_lines()
            assert next(lines).startswith("data: {")
            os.kill(server.core_pid(), signal.SIGKILL)
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
        except httpx.ConnectError:
            pass
        assert server.wait(EXIT_WITHIN_S) == 1, server.log_tail()
        print(f"core killed: stream error after {ended_after * 1000:.0f} ms, "
              f"server exit 1 after {time.monotonic() - killed_at:.2f} s")
