"""POST /v1/messages (Anthropic Messages) and /v1/messages/count_tokens: a chat answer framed as
Anthropic's content blocks and stream events, and errors in Anthropic's shape."""

from __future__ import annotations

import copy
import json
from collections.abc import AsyncIterator
from typing import Any

from tailrace.engine.client import EngineClient
from tailrace.serving.chat import render_prompt
from tailrace.serving.chat_deltas import Delta, RunningUsage, chat_deltas, drain, framed
from tailrace.serving.context import RequestContext
from tailrace.serving.errors import OpenAIError
from tailrace.serving.protocol_anthropic import CountTokensRequest, MessagesRequest

# Anthropic's error type for each status it uses; other statuses take the nearest class's.
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
                500: "api_error", 504: "timeout_error", 529: "overloaded_error"}
# Where Anthropic answers the same condition with another status: overloaded, timed out.
_STATUSES = {503: 529, 408: 504}


def error_body(err: OpenAIError) -> dict[str, Any]:
    """`{"type": "error", "error": {"type", "message"}}`, the shape the Anthropic SDK reads."""
    status = _STATUSES.get(err.status, err.status)
    kind = _ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": err.message}}


class AnthropicError(OpenAIError):
    """An error answered on an Anthropic route: same status and headers, Anthropic's body."""

    @classmethod
    def of(cls, err: OpenAIError) -> AnthropicError:
        converted = cls(_STATUSES.get(err.status, err.status), err.message, err.type, err.param, err.code)
        converted.headers = err.headers
        return converted

    def body(self) -> dict[str, Any]:
        return error_body(self)


async def create_message(engine: EngineClient, request: MessagesRequest, ctx: RequestContext,
                         sampling_defaults: dict[str, float]) -> dict[str, Any] | AsyncIterator[dict[str, Any]]:
    """Validate and start now (errors raise OpenAIError); then the message, or its stream events."""
    run = await chat_deltas(engine, request.chat_request(), ctx, sampling_defaults)
    framer = MessageFramer(f"msg_{ctx.request_id.removeprefix('req-')}", ctx.model_name, run.usage)
    events = framed(run, framer, request.stream)
    if request.stream:
        return events
    await drain(events)
    return framer.message


def count_tokens(engine: EngineClient, request: CountTokensRequest, ctx: RequestContext) -> dict[str, Any]:
    prompt, _ = render_prompt(engine, request.chat_request(), ctx)
    return {"input_tokens": len(prompt.token_ids)}


def stop_reason(delta: Delta) -> tuple[str, str | None]:
    """Anthropic's stop_reason for how the answer ended, and the stop sequence that ended it."""
    if delta.finish_reason == "length":
        return "max_tokens", None
    if delta.finish_reason == "tool_calls":
        return "tool_use", None
    if isinstance(delta.stop_reason, str):
        return "stop_sequence", delta.stop_reason
    return "end_turn", None


class MessageFramer:
    """Deltas in, Anthropic's stream events out. `message` is what those events build, updated as
    the SDK's accumulator updates its snapshot: the non-stream response is exactly that."""

    def __init__(self, message_id: str, model: str, usage: RunningUsage) -> None:
        self.message: dict[str, Any] = {"id": message_id, "type": "message", "role": "assistant", "model": model,
                                        "content": [], "stop_reason": None, "stop_sequence": None, "stop_details": None,
                                        "usage": {}}
        self._usage = usage
        self._open: str | None = None  # the kind of the last block while it is open
        self._call_blocks: dict[int, int] = {}  # tool-call index -> content block index
        self._json: dict[int, str] = {}  # content block index -> its tool input so far

    def feed(self, delta: Delta) -> list[dict[str, Any]]:
        events = [] if self.message["usage"] else [self._start()]
        if delta.reasoning:
            events += self._text("thinking", delta.reasoning)
        if delta.content:
            events += self._text("text", delta.content)
        for call in delta.calls:
            events += self._call(call.index, call.id, call.name, call.arguments)
        if delta.finish_reason is not None:
            events += self._end(delta)
        return events

    def finish(self) -> list[dict[str, Any]]:
        return []  # the finishing delta ended the message

    def fail(self, error: OpenAIError) -> list[dict[str, Any]]:
        return [error_body(error)]

    def _start(self) -> dict[str, Any]:
        self.message["usage"] = {"input_tokens": self._usage.input_tokens - self._usage.cached_tokens,
                                 "output_tokens": 0, "cache_creation_input_tokens": 0,
                                 "cache_read_input_tokens": self._usage.cached_tokens}
        return {"type": "message_start", "message": copy.deepcopy(self.message)}

    def _text(self, kind: str, text: str) -> list[dict[str, Any]]:
        events = []
        if self._open != kind:
            events = self._open_block({"type": kind, kind: ""} | ({"signature": ""} if kind == "thinking" else {}))
        index = len(self.message["content"]) - 1
        self.message["content"][index][kind] += text
        events.append({"type": "content_block_delta", "index": index,
                       "delta": {"type": f"{kind}_delta", kind: text}})
        return events

    def _call(self, call: int, call_id: str | None, name: str | None, arguments: str) -> list[dict[str, Any]]:
        events = []
        if call_id is not None:
            events = self._open_block({"type": "tool_use", "id": call_id, "name": name, "input": {}})
            self._call_blocks[call] = len(self.message["content"]) - 1
        index = self._call_blocks[call]
        if arguments:
            self._json[index] = self._json.get(index, "") + arguments
            events.append({"type": "content_block_delta", "index": index,
                           "delta": {"type": "input_json_delta", "partial_json": arguments}})
        return events

    def _open_block(self, block: dict[str, Any]) -> list[dict[str, Any]]:
        events = self._close_block()
        self.message["content"].append(block)
        self._open = block["type"]
        events.append({"type": "content_block_start", "index": len(self.message["content"]) - 1,
                       "content_block": copy.deepcopy(block)})
        return events

    def _close_block(self) -> list[dict[str, Any]]:
        if self._open is None:
            return []
        self._open = None
        index = len(self.message["content"]) - 1
        if index in self._json:
            self.message["content"][index]["input"] = _json_object(self._json[index])
        return [{"type": "content_block_stop", "index": index}]

    def _end(self, delta: Delta) -> list[dict[str, Any]]:
        events = self._close_block()
        reason, sequence = stop_reason(delta)
        self.message.update(stop_reason=reason, stop_sequence=sequence)
        self.message["usage"]["output_tokens"] = self._usage.output_tokens
        events.append({"type": "message_delta",
                       "delta": {"stop_reason": reason, "stop_sequence": sequence, "stop_details": None},
                       "usage": dict(self.message["usage"])})
        events.append({"type": "message_stop"})
        return events


def _json_object(text: str) -> dict[str, Any]:
    """A tool call's input; arguments cut short (max_tokens) read as far as they are whole JSON."""
    try:
        value = json.loads(text)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}
