"""Servers for `tailrace check` to look at: the broken fixture (in this process, on a thread) and a
real `tailrace serve` on the embedded model (the e2e session's own fixture, reused)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest
import uvicorn

from e2e.conftest import model_dir, server_url, speculative_server_url  # noqa: F401  (fixtures, reused as they are)
from e2e.conftest import free_port

from tailrace.check.client import Client
from tailrace.check.results import Result
from tailrace.check.runner import run_checks, select
from tailrace.check.session import Session

from .broken_server import build_app

READY_TIMEOUT_S = 20.0


@pytest.fixture(scope="session")
def fixture_url() -> Iterator[str]:
    """`http://127.0.0.1:<port>`; each bug is served under /bugs/<name>, the correct server under /bugs/none."""
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(build_app(), host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + READY_TIMEOUT_S
    while not server.started:
        if time.monotonic() > deadline:
            pytest.fail("the broken-server fixture did not start")
        time.sleep(0.05)
    yield url
    server.should_exit = True
    thread.join(READY_TIMEOUT_S)


def bug_url(fixture_url: str, bug: str) -> str:
    return f"{fixture_url}/bugs/{bug}/v1"


def run_against(base_url: str, api_key: str, model: str, groups: list[str] | None = None) -> list[Result]:
    """Every check (or those of `groups`), in this process."""
    client = Client(base_url, api_key, timeout_s=60.0)
    try:
        return run_checks(Session(client, model), select(groups, None))
    finally:
        client.close()


def verdict(results: list[Result], name: str) -> Result:
    return next(result for result in results if result.name == name)
