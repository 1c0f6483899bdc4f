"""tailrace itself passes every check on the embedded model: a real `tailrace serve`, over HTTP."""

from __future__ import annotations

import pytest

from e2e.conftest import API_KEY, MODEL
from tailrace.check.results import FAIL, IGNORED, SKIP, Result

from .conftest import run_against


@pytest.fixture(scope="module", params=["server_url", "speculative_server_url"], ids=["plain", "speculative"])
def results(request: pytest.FixtureRequest) -> list[Result]:
    return run_against(f"{request.getfixturevalue(request.param)}/v1", API_KEY, MODEL)


def test_tailrace_fails_no_check(results: list[Result]):
    assert [(r.group, r.name, r.reason) for r in results if r.status == FAIL] == []


def test_tailrace_serves_every_vllm_extension_the_checks_use(results: list[Result]):
    # Only UTF-8 may skip: the embedded model writes ASCII.
    assert {(r.group, r.name) for r in results if r.status in (IGNORED, SKIP)} <= {
        ("utf8", "completions multi-byte text"), ("utf8", "chat multi-byte text")}
