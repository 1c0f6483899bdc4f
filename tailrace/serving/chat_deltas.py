"""The chat path as the Responses and Messages APIs consume it: one chat request, streamed, its
chunk pieces read back as plain deltas.

Those APIs are framings of a chat answer. They translate their request into a
`ChatCompletionRequest` and frame what this yields, so generation, hold-back, stop strings, tool
calls, grammars, reasoning and logprobs stay in the chat path, and their stream and non-stream
answers come from the same deltas.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any, Protocol

from tailrace.engine.client import EngineClient
from tailrace.serving.chat import create_chat_completion
from tailrace.serving.context import RequestContext
from tailrace.serving.errors import OpenAIError, internal
from tailrace.serving.protocol import ChatCompletionRequest, StreamOptions
from tailrace.serving.sampling_defaults import with_sampling_defaults

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class CallDelta:
    """A piece of one tool call: `id` and `name` on its first piece only."""

    index: int
    id: str | None
    name: str | None
    arguments: str


@dataclass(slots=True)
class Delta:
    """What one chat piece added to the answer."""

    reasoning: str = ""
    content: str = ""
    calls: list[CallDelta] = field(default_factory=list)
    logprobs: list[dict[str, Any]] = field(default_factory=list)  # chat's `logprobs.content` entries
    finish_reason: str | None = None  # chat's: stop | length | tool_calls | abort
    stop_reason: str | int | None = None  # the stop string or token id that ended it


@dataclass(slots=True)
class RunningUsage:
    """Running totals, as of the last delta read."""

    input_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    reasoning_tokens: int = 0  # output tokens of steps that added only reasoning


class ChatDeltas:
    """The deltas of one chat answer (choice 0 of an n=1 request) and its usage so far."""

    def __init__(self, chunks: AsyncIterator[dict[str, Any]], reasoning_field: str,
                 request: ChatCompletionRequest) -> None:
        self._chunks = chunks
        self._reasoning_field = reasoning_field
        self.request = request  # as it runs: the model's sampling defaults filled in
        self.usage = RunningUsage()

    async def deltas(self) -> AsyncIterator[Delta]:
        """Closing this (the client went away) closes the chat stream, which aborts the request."""
        async with aclosing(self._chunks) as chunks:
            async for chunk in chunks:
                for piece in chunk["choices"]:
                    delta = self._read(piece)
                    self._count(chunk["usage"], piece, delta)
                    yield delta

    def _read(self, piece: dict[str, Any]) -> Delta:
        fields = piece["delta"]
        calls = [CallDelta(c["index"], c.get("id"), c["function"].get("name"), c["function"]["arguments"])
                 for c in fields.get("tool_calls", [])]
        logprobs = piece["logprobs"]["content"] if piece["logprobs"] else []
        return Delta(fields.get(self._reasoning_field) or "", fields.get("content") or "", calls, logprobs,
                     piece["finish_reason"], piece.get("stop_reason"))

    def _count(self, usage: dict[str, Any], piece: dict[str, Any], delta: Delta) -> None:
        # Every piece of a step repeats the usage after it; the role piece opens the first step
        # and says nothing, so the step's tokens go to the piece that shows what they were.
        if "role" in piece["delta"]:
            self.usage.input_tokens = usage["prompt_tokens"]
            self.usage.cached_tokens = usage["prompt_tokens_details"]["cached_tokens"]
            return
        new = usage["completion_tokens"] - self.usage.output_tokens
        self.usage.output_tokens = usage["completion_tokens"]
        if delta.reasoning and not (delta.content or delta.calls):
            self.usage.reasoning_tokens += new


async def chat_deltas(engine: EngineClient, request: ChatCompletionRequest, ctx: RequestContext,
                      sampling_defaults: dict[str, float]) -> ChatDeltas:
    """Validate and start now (an OpenAIError raises here, before anything is sent); the deltas
    come from `deltas()` of the result."""
    request = with_sampling_defaults(request, sampling_defaults).model_copy(update={
        "stream": True, "stream_options": StreamOptions(include_usage=True, continuous_usage_stats=True)})
    chunks = await create_chat_completion(engine, request, ctx)
    assert not isinstance(chunks, dict)  # a stream was asked for
    return ChatDeltas(chunks, ctx.chat.reasoning_field, request)


class Framer(Protocol):
    """An API's framing of one answer: the events each delta makes, and the object those events
    build, which is that API's non-stream answer."""

    def feed(self, delta: Delta) -> list[dict[str, Any]]: ...

    def finish(self) -> list[dict[str, Any]]: ...

    def fail(self, error: OpenAIError) -> list[dict[str, Any]]:
        """The events that report an error after the stream has begun."""
        ...


async def framed(run: ChatDeltas, framer: Framer, stream: bool) -> AsyncIterator[dict[str, Any]]:
    """The framer's events for every delta of the run. An error before the first event raises (so
    it becomes an HTTP error); a stream reports a later one with the framer's own events."""
    sent = False
    try:
        async with aclosing(run.deltas()) as deltas:
            async for delta in deltas:
                for event in framer.feed(delta):
                    sent = True
                    yield event
    except Exception as exc:
        if not (stream and sent):
            raise
        if not isinstance(exc, OpenAIError):
            logger.exception("stream failed mid-response")
        for event in framer.fail(exc if isinstance(exc, OpenAIError) else internal()):
            yield event
        return
    for event in framer.finish():
        yield event


async def drain(events: AsyncIterator[dict[str, Any]]) -> None:
    """Run a non-stream answer's events to the end; the framer keeps what they built."""
    async with aclosing(events) as running:
        async for _ in running:
            pass
