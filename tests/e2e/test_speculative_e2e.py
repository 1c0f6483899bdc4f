"""Through HTTP, a server that speculates answers what the plain server answers, token for token
and logprob for logprob, and counts its guesses in /metrics as vLLM does."""

from __future__ import annotations

import re
from collections.abc import Iterator

import httpx
import pytest

from .conftest import MODEL, SPECULATIVE_CONFIG, THROUGH_RAY

pytestmark = pytest.mark.skipif(THROUGH_RAY, reason="the speculative server is a plain `tailrace serve`")

CODE = '''def parse(text):
    fields = text.split(",")
    return [field.strip() for field in fields]


def parse(text):
'''
REQUESTS = [
    ("/v1/completions", {"prompt": CODE, "max_tokens": 48, "temperature": 0, "logprobs": 3}),
    ("/v1/completions", {"prompt": CODE, "max_tokens": 48, "temperature": 0.6, "seed": 11, "n": 2,
                         "logprobs": 1}),
    ("/v1/completions", {"prompt": CODE * 2, "max_tokens": 40, "temperature": 0, "stop": ["return"]}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Repeat this:\n" + CODE}],
                              "max_tokens": 48, "temperature": 0, "logprobs": True, "top_logprobs": 2}),
]


@pytest.fixture(scope="module")
def speculative(speculative_server_url: str, auth: dict[str, str]) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=speculative_server_url, headers=auth, timeout=60.0) as client:
        yield client


def answer(client: httpx.Client, path: str, body: dict) -> dict:
    response = client.post(path, json={"model": MODEL, **body})
    assert response.status_code == 200, response.text
    return response.json()


@pytest.mark.parametrize("path, body", REQUESTS, ids=lambda v: v if isinstance(v, str) else None)
def test_speculative_server_answers_exactly_what_the_plain_one_does(http, speculative, path, body):
    plain, guessed = answer(http, path, body), answer(speculative, path, body)
    assert guessed["choices"] == plain["choices"]
    assert guessed["usage"] == plain["usage"]


def test_metrics_count_drafts_and_accepted_tokens_per_position(speculative):
    for path, body in REQUESTS:
        answer(speculative, path, body)
    text = speculative.get("/metrics").text

    def value(name: str) -> float:
        found = re.search(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.M)
        assert found, f"{name} missing from /metrics"
        return float(found.group(1))

    drafts, tokens = value("vllm:spec_decode_num_drafts_total"), value("vllm:spec_decode_num_draft_tokens_total")
    accepted = value("vllm:spec_decode_num_accepted_tokens_total")
    assert 0 < accepted < tokens and drafts <= tokens <= drafts * SPECULATIVE_CONFIG["num_speculative_tokens"]
    positions = re.findall(r'^vllm:spec_decode_num_accepted_tokens_per_pos_total\{[^}]*position="(\d)"[^}]*\} (\S+)$',
                           text, re.M)
    assert [p for p, _ in positions] == ["0", "1", "2", "3"]
    assert sum(float(v) for _, v in positions) == accepted
