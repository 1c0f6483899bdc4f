"""Schema-driven fuzzing (schemathesis) of the server's own OpenAPI document, over real HTTP.

Every operation gets requests that fit its schema (positive) and requests that break it (negative).
Whatever comes, the answer is a 2xx or a 4xx in OpenAI's error shape, never a 5xx nor FastAPI's
422 `detail`, a 200 stream carries no in-band error, and the server is still healthy at the end.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode

from harness import ServerProcess

# Requests per (operation with a body, mode); the GET operations add a few more.
CI_EXAMPLES = 40
FULL_EXAMPLES = 150
REQUEST_TIMEOUT_S = 60.0


@dataclass
class FuzzReport:
    requests: int = 0
    statuses: Counter = field(default_factory=Counter)
    failures: list[str] = field(default_factory=list)

    def summary(self) -> str:
        return f"{self.requests} requests, statuses {dict(sorted(self.statuses.items()))}"


def response_problem(status: int, content_type: str, body: bytes) -> str | None:
    """What is wrong with one answer, or None."""
    if status >= 500:
        return f"server error {status}"
    if 400 <= status < 500:
        try:
            error = json.loads(body)["error"]
        except (ValueError, KeyError, TypeError):
            return f"{status} not in OpenAI's error shape"
        if set(json.loads(body)) != {"error"} or set(error) != {"message", "type", "param", "code"}:
            return f"{status} not in OpenAI's error shape"
        return None
    if content_type.startswith("text/event-stream"):
        for line in body.decode(errors="replace").splitlines():
            if line.startswith("data: {") and '"error":' in line and json.loads(line[6:]).get("error"):
                return "in-band error in a 200 stream"
    return None


def fuzz(server: ServerProcess, examples: int) -> FuzzReport:
    schema = schemathesis.openapi.from_url(f"{server.url}/openapi.json", headers=server.headers, timeout=30)
    report = FuzzReport()
    for result in schema.get_all_operations():
        operation = result.ok()
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            _run(operation, mode, server, examples, report)
    return report


def _run(operation: schemathesis.APIOperation, mode: GenerationMode, server: ServerProcess, examples: int,
         report: FuzzReport) -> None:
    # No shrinking and no stop at the first failure: every problem is recorded and counted.
    @settings(max_examples=examples, deadline=None, database=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(case=operation.as_strategy(generation_mode=mode))
    def send(case: schemathesis.Case) -> None:
        response = case.call(base_url=server.url, headers=server.headers, timeout=REQUEST_TIMEOUT_S)
        report.requests += 1
        report.statuses[response.status_code] += 1
        content_type = (response.headers.get("content-type") or [""])[0]
        problem = response_problem(response.status_code, content_type, response.content)
        if problem is not None:
            report.failures.append(f"{problem}: {case.method} {case.formatted_path} body={case.body!r:.300} "
                                   f"-> {response.content[:300]!r}")

    try:
        send()
    except Unsatisfiable:
        pass  # an operation without parameters has no negative cases


def assert_clean(report: FuzzReport, server: ServerProcess, minimum: int) -> None:
    assert not report.failures, f"{len(report.failures)} bad answers of {report.summary()}:\n" + \
        "\n".join(report.failures[:20])
    assert report.requests >= minimum, report.summary()
    assert httpx.get(server.url + "/health", timeout=5.0).status_code == 200


def test_fuzzed_requests_get_2xx_or_openai_shaped_4xx(server: ServerProcess) -> None:
    report = fuzz(server, CI_EXAMPLES)
    print(report.summary())
    assert_clean(report, server, minimum=300)


@pytest.mark.slow
def test_two_thousand_fuzzed_requests_get_2xx_or_openai_shaped_4xx(server: ServerProcess) -> None:
    report = fuzz(server, FULL_EXAMPLES)
    print(report.summary())
    assert_clean(report, server, minimum=2000)
