"""Proof that `tailrace check` finds real bugs: each bug injected into the fixture server fails the
check named for it, and the fixture with no bug fails nothing."""

from __future__ import annotations

import json
import shlex

import httpx
import pytest

from tailrace.check.results import FAIL, IGNORED, PASS

from .broken_server import API_KEY, BUGS, MODEL
from .conftest import bug_url, run_against, verdict

# bug -> (group, the check that has to fail)
CAUGHT_BY = {
    "cumulative": ("equivalence", "completions greedy"),
    "echo_offsets": ("offsets", "first offset"),
    "offset_drift": ("offsets", "offsets across chunks"),
    "stop_prefix_leak": ("stop", "completions stop across tokens"),
    "utf8_split": ("utf8", "completions multi-byte text"),
    "logprobs_ahead": ("stop", "completions stop with logprobs"),
    "no_done": ("framing", "[DONE] last"),
    "double_usage": ("usage", "one usage chunk"),
    "shared_choices": ("n", "completions choices apart"),
    "shared_sampler": ("n", "chat choices apart"),
    "error_422": ("errors", "invalid value"),
    "tool_args_cumulative": ("tools", "chat required call"),
    "tool_name_repeated": ("tools", "chat required call"),
    "tool_finish_stop": ("tools", "chat named call"),
}


@pytest.fixture(scope="module")
def clean_results(fixture_url: str) -> list:
    return run_against(bug_url(fixture_url, "none"), API_KEY, MODEL)


def test_every_injectable_bug_has_a_check_that_catches_it():
    assert set(CAUGHT_BY) == set(BUGS)


@pytest.mark.parametrize("bug", sorted(CAUGHT_BY))
def test_injected_bug_fails_its_check(fixture_url: str, bug: str):
    group, name = CAUGHT_BY[bug]
    results = run_against(bug_url(fixture_url, bug), API_KEY, MODEL, [group])
    assert verdict(results, name).status == FAIL, verdict(results, name)


def test_clean_fixture_fails_no_check(clean_results: list):
    assert [(r.group, r.name, r.reason) for r in clean_results if r.status == FAIL] == []


def test_clean_fixture_passes_all_but_the_vllm_extension_it_lacks(clean_results: list):
    assert {r.name: r.status for r in clean_results if r.status != PASS} == {"continuous usage": IGNORED}


def test_failure_reproducer_is_the_request_that_shows_the_bug(fixture_url: str):
    results = run_against(bug_url(fixture_url, "no_done"), API_KEY, MODEL, ["framing"])
    command = shlex.split(verdict(results, "[DONE] last").reproducer)
    url, body = command[2], json.loads(command[command.index("-d") + 1])
    reply = httpx.post(url, json=body, headers={"Authorization": f"Bearer {API_KEY}"})
    assert body["stream"] is True and b"[DONE]" not in reply.content
