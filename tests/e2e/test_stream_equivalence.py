"""The acceptance matrix: a stream, joined per choice, says exactly what the same request says
without streaming; and every stream is well formed on the wire.

(completions | chat) x echo x logprobs x n x stop x include_usage. Sampling at temperature 1 with a
seed: the two requests draw the same tokens, and n=2 siblings differ. The stop string of a cell is
cut from the middle of what the same request generates without one, so it really occurs; the seed
is the first from SEED whose text is long enough for that.
The stream is read with raw httpx and parsed here, so the exact framing is what is checked.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from .conftest import MODEL, THROUGH_RAY

MAX_TOKENS = 16
SEED = 1234
MAX_SEED_TRIES = 20
MIN_PROBE_CHARS = 24  # a seed must give this much text: short outputs test little
LOGPROB_TOLERANCE = 1e-4  # batch numerics may drift by ~1e-7
PROMPT = "Once upon a time"
USER_MESSAGE = {"role": "user", "content": "Tell me a story."}
ECHOED_MESSAGE = {"role": "assistant", "content": "Once upon a time"}  # chat echo continues this
DONE_EVENT = b"data: [DONE]"


@dataclass(frozen=True)
class Cell:
    endpoint: str  # "completions" | "chat"
    echo: bool
    logprobs: bool
    n: int
    stop: bool
    include_usage: bool

    def __str__(self) -> str:
        flags = [name for name in ("echo", "logprobs", "stop", "include_usage") if getattr(self, name)]
        return "-".join([self.endpoint, f"n{self.n}", *flags])

    @property
    def path(self) -> str:
        return "/v1/completions" if self.endpoint == "completions" else "/v1/chat/completions"

    def body(self, seed: int, stop: str | None) -> dict[str, Any]:
        body: dict[str, Any] = {"model": MODEL, "max_tokens": MAX_TOKENS, "temperature": 1.0, "seed": seed,
                                "n": self.n, "echo": self.echo}
        if self.endpoint == "completions":
            body["prompt"] = PROMPT
            if self.logprobs:
                body["logprobs"] = 2
        else:
            body["messages"] = [USER_MESSAGE, ECHOED_MESSAGE] if self.echo else [USER_MESSAGE]
            if self.logprobs:
                body.update(logprobs=True, top_logprobs=2)
        if stop is not None:
            body["stop"] = stop
        return body

    def echoed(self) -> str:
        if not self.echo:
            return ""
        return PROMPT if self.endpoint == "completions" else ECHOED_MESSAGE["content"]


CELLS = [Cell(*values) for values in itertools.product(("completions", "chat"), (False, True), (False, True),
                                                       (1, 2), (False, True), (False, True))]


@dataclass
class Exchange:
    full: dict[str, Any]  # the stream=False response
    content_type: str  # of the stream=True response
    chunks: list[dict[str, Any]]  # its events, framing checked


# ---- reading the wire -------------------------------------------------------------------------------

def parse_sse(body: bytes) -> list[dict[str, Any]]:
    """`data: <one-line JSON>\\n\\n` events ending with `data: [DONE]\\n\\n`; anything else fails."""
    assert body.endswith(DONE_EVENT + b"\n\n"), f"the stream does not end with [DONE]: {body[-200:]!r}"
    events = body[:-2].split(b"\n\n")
    assert events[-1] == DONE_EVENT
    chunks = []
    for event in events[:-1]:
        assert b"\n" not in event and event.startswith(b"data: "), f"not one data line: {event[:200]!r}"
        chunks.append(json.loads(event[len(b"data: "):]))
    return chunks


def generated_text(cell: Cell, choice: dict[str, Any]) -> str:
    text = choice["text"] if cell.endpoint == "completions" else choice["message"]["content"]
    assert text.startswith(cell.echoed())
    return text[len(cell.echoed()):]


def stop_string_from(text: str) -> str | None:
    """A short non-blank piece from the middle of `text`; None when `text` is too short for one."""
    if len(text) < MIN_PROBE_CHARS:
        return None
    for start in range(len(text) // 2, len(text) - 1):
        piece = text[start:start + 2]
        if piece.strip() == piece:
            return piece
    return None


class Exchanges:
    """Each cell's requests, made once and shared by the tests that look at them."""

    def __init__(self, http: httpx.Client) -> None:
        self.http = http
        self.done: dict[Cell, Exchange] = {}
        self.probes: dict[tuple, tuple[int, str]] = {}

    def __call__(self, cell: Cell) -> Exchange:
        if cell not in self.done:
            self.done[cell] = self._run(cell)
        return self.done[cell]

    def _run(self, cell: Cell) -> Exchange:
        seed, stop = self._probe(cell)
        body = cell.body(seed, stop if cell.stop else None)
        full = self.http.post(cell.path, json=body)
        assert full.status_code == 200, full.text
        streamed = {**body, "stream": True, "stream_options": {"include_usage": cell.include_usage}}
        response = self.http.post(cell.path, json=streamed)
        assert response.status_code == 200, response.text
        exchange = Exchange(full.json(), response.headers["content-type"], parse_sse(response.content))
        # Preconditions: without them a cell would not be testing what it is named for.
        choices = exchange.full["choices"]
        if cell.stop:
            assert choices[0]["finish_reason"] == "stop" and stop not in generated_text(cell, choices[0])
        if cell.n == 2:
            assert generated_text(cell, choices[0]) != generated_text(cell, choices[1]), "siblings must differ"
        return exchange

    def _probe(self, cell: Cell) -> tuple[int, str]:
        """The first seed from SEED on whose choice 0, without a stop, generates enough text to cut a
        stop string from; the same seed serves the cell's stop and no-stop variants."""
        key = (cell.endpoint, cell.echo, cell.logprobs, cell.n)
        if key not in self.probes:
            for seed in range(SEED, SEED + MAX_SEED_TRIES):
                response = self.http.post(cell.path, json=cell.body(seed, None))
                assert response.status_code == 200, response.text
                stop = stop_string_from(generated_text(cell, response.json()["choices"][0]))
                if stop is not None:
                    self.probes[key] = seed, stop
                    break
            else:
                pytest.fail(f"no seed in {MAX_SEED_TRIES} tries generated enough text for a stop string in {cell}")
        return self.probes[key]


@pytest.fixture(scope="module", params=["plain"] if THROUGH_RAY else ["plain", "speculative"])
def exchanges(request: pytest.FixtureRequest, http: httpx.Client, auth: dict[str, str]) -> Iterator[Exchanges]:
    """The session's server, then the same one with speculative decoding on."""
    if request.param == "plain":
        yield Exchanges(http)
        return
    url = request.getfixturevalue("speculative_server_url")
    with httpx.Client(base_url=url, headers=auth, timeout=60.0) as client:
        yield Exchanges(client)


# ---- joining a stream -------------------------------------------------------------------------------

def join_stream(cell: Cell, chunks: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The stream's choices as non-stream choices (index order)."""
    joined: dict[int, dict[str, Any]] = {}
    for chunk in chunks:
        for piece in chunk["choices"]:
            choice = joined.setdefault(piece["index"], _empty_choice(cell, piece["index"]))
            if cell.endpoint == "completions":
                choice["text"] += piece["text"]
                if piece["logprobs"] is not None:
                    for key, values in piece["logprobs"].items():
                        choice["logprobs"][key] += values
            else:
                choice["message"]["content"] += piece["delta"].get("content") or ""
                if piece["logprobs"] is not None:
                    choice["logprobs"]["content"] += piece["logprobs"]["content"]
            if piece["finish_reason"] is not None:
                choice["finish_reason"] = piece["finish_reason"]
                choice["stop_reason"] = piece.get("stop_reason")
    return [joined[i] for i in sorted(joined)]


def _empty_choice(cell: Cell, index: int) -> dict[str, Any]:
    if cell.endpoint == "completions":
        logprobs = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        return {"index": index, "text": "", "logprobs": logprobs if cell.logprobs else None,
                "finish_reason": None, "stop_reason": None}
    return {"index": index, "message": {"content": ""},
            "logprobs": {"content": []} if cell.logprobs else None, "finish_reason": None}


def assert_close(streamed: float | None, full: float | None, where: str) -> None:
    if full is None:
        assert streamed is None, where
    else:
        assert streamed == pytest.approx(full, abs=LOGPROB_TOLERANCE), where


def assert_same_completion_logprobs(streamed: dict[str, list], full: dict[str, list]) -> None:
    assert streamed["tokens"] == full["tokens"]
    assert streamed["text_offset"] == full["text_offset"]
    assert len(streamed["token_logprobs"]) == len(full["token_logprobs"]) == len(full["tokens"])
    for i, (got, want) in enumerate(zip(streamed["token_logprobs"], full["token_logprobs"])):
        assert_close(got, want, f"token_logprobs[{i}]")
    assert len(streamed["top_logprobs"]) == len(full["top_logprobs"])
    for i, (got, want) in enumerate(zip(streamed["top_logprobs"], full["top_logprobs"])):
        if want is None:
            assert got is None, f"top_logprobs[{i}]"
            continue
        assert list(got) == list(want), f"top_logprobs[{i}] keys"
        for token in want:
            assert_close(got[token], want[token], f"top_logprobs[{i}][{token!r}]")


def assert_same_chat_logprobs(streamed: list[dict[str, Any]], full: list[dict[str, Any]]) -> None:
    assert [t["token"] for t in streamed] == [t["token"] for t in full]
    assert [t["bytes"] for t in streamed] == [t["bytes"] for t in full]
    for i, (got, want) in enumerate(zip(streamed, full)):
        assert_close(got["logprob"], want["logprob"], f"content[{i}].logprob")
        assert [t["token"] for t in got["top_logprobs"]] == [t["token"] for t in want["top_logprobs"]], \
            f"content[{i}].top_logprobs tokens"
        for j, (alt_got, alt_want) in enumerate(zip(got["top_logprobs"], want["top_logprobs"])):
            assert_close(alt_got["logprob"], alt_want["logprob"], f"content[{i}].top_logprobs[{j}]")


# ---- the matrix -------------------------------------------------------------------------------------

@pytest.mark.parametrize("cell", CELLS, ids=str)
def test_joined_stream_equals_non_stream_response(cell: Cell, exchanges: Exchanges) -> None:
    exchange = exchanges(cell)
    streamed, full = join_stream(cell, exchange.chunks), exchange.full["choices"]
    assert [c["index"] for c in streamed] == [c["index"] for c in full] == list(range(cell.n))
    for got, want in zip(streamed, full):
        assert got["finish_reason"] == want["finish_reason"]
        if cell.endpoint == "completions":
            assert got["text"] == want["text"]
            assert got["stop_reason"] == want["stop_reason"]
            if cell.logprobs:
                assert_same_completion_logprobs(got["logprobs"], want["logprobs"])
        else:
            assert got["message"]["content"] == want["message"]["content"]
            if cell.logprobs:
                assert_same_chat_logprobs(got["logprobs"]["content"], want["logprobs"]["content"])
    if cell.include_usage:
        assert exchange.chunks[-1]["usage"] == exchange.full["usage"]


@pytest.mark.parametrize("cell", CELLS, ids=str)
def test_stream_is_well_formed(cell: Cell, exchanges: Exchanges) -> None:
    exchange = exchanges(cell)
    assert exchange.content_type.startswith("text/event-stream")
    chunks = exchange.chunks  # parse_sse already checked the framing and the final [DONE]
    object_name = "text_completion" if cell.endpoint == "completions" else "chat.completion.chunk"
    assert {(c["id"], c["created"], c["object"], c["model"]) for c in chunks} == \
        {(chunks[0]["id"], chunks[0]["created"], object_name, MODEL)}

    usage_chunks = [i for i, c in enumerate(chunks) if c.get("usage") is not None]
    if cell.include_usage:
        assert usage_chunks == [len(chunks) - 1]
        assert chunks[-1]["choices"] == []
        chunks = chunks[:-1]
    else:
        assert usage_chunks == []
    assert all(len(c["choices"]) == 1 for c in chunks), "every chunk carries exactly one choice"

    pieces = [c["choices"][0] for c in chunks]
    if cell.endpoint == "chat":
        assert all(isinstance(p.get("delta"), dict) for p in pieces), "every chat choice has a delta, {} at least"
    indices = [p["index"] for p in pieces]
    assert list(dict.fromkeys(indices)) == list(range(cell.n)), "choices are introduced in ascending index"
    for index in range(cell.n):
        own = [p for p in pieces if p["index"] == index]
        finishes = [i for i, p in enumerate(own) if p["finish_reason"] is not None]
        assert finishes == [len(own) - 1], f"choice {index}: one finish_reason, on its last chunk"
        if cell.endpoint == "chat":
            roles = [i for i, p in enumerate(own) if "role" in p["delta"]]
            assert roles == [0] and own[0]["delta"]["role"] == "assistant", f"choice {index}: role first, once"


@pytest.mark.parametrize("cell", [c for c in CELLS if c.logprobs], ids=str)
def test_streamed_token_count_matches_usage(cell: Cell, exchanges: Exchanges) -> None:
    """The streamed logprob entries of the generated tokens are the completion tokens usage counts."""
    exchange = exchanges(cell)
    usage = exchange.full["usage"]
    echoed = usage["prompt_tokens"] if cell.echo and cell.endpoint == "completions" else 0
    counts = [len(c["logprobs"]["tokens"]) - echoed if cell.endpoint == "completions"
              else len(c["logprobs"]["content"]) for c in join_stream(cell, exchange.chunks)]
    assert all(count <= MAX_TOKENS for count in counts)
    assert sum(counts) == usage["completion_tokens"]
