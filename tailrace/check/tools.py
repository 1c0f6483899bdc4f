"""Tool calls, streamed and not: a call the request forces (tool_choice "required", or the
function by name) comes back as `tool_calls` both ways, and the stream's pieces join to the
non-stream calls. Each call is named once, on its first piece, with its id and type, and every
piece carries its index. The arguments join to one JSON object, the same one as without
streaming. The stream ends with the same finish_reason."""

from __future__ import annotations

import json
from typing import Any

from tailrace.check.client import Exchange
from tailrace.check.expect import ok_json
from tailrace.check.results import fail, skip
from tailrace.check.session import Check, Session

GROUP = "tools"
TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
MAX_TOKENS = 64
Call = tuple[str, str]  # (name, arguments as sent)


def non_stream_calls(exchange: Exchange) -> tuple[list[Call], str | None]:
    """The answer's calls and finish_reason, or a failure naming what a call lacks."""
    choice = (ok_json(exchange).get("choices") or [{}])[0]
    calls = (choice.get("message") or {}).get("tool_calls") or []
    if not calls:
        fail("a forced call came back without tool_calls", exchange)
    for call in calls:
        if not call.get("id") or call.get("type") != "function" or "function" not in call:
            fail(f"a tool call lacks its id, type or function: {call}", exchange)
    return [(c["function"].get("name"), c["function"].get("arguments")) for c in calls], choice.get("finish_reason")


def streamed_calls(exchange: Exchange) -> tuple[list[Call], str | None]:
    """The calls a stream's pieces join to, and its finish_reason; a failure at the first piece
    that breaks the rules clients join them by."""
    names: list[str] = []
    arguments: list[str] = []
    finish = None
    for chunk in exchange.chunks():
        for part in chunk.get("choices") or []:
            finish = part.get("finish_reason") or finish
            for delta in (part.get("delta") or {}).get("tool_calls") or []:
                index, function = delta.get("index"), delta.get("function") or {}
                if index is None:
                    fail(f"a tool-call piece without its index: {delta}", exchange)
                if index == len(names):
                    if not (delta.get("id") and delta.get("type") == "function" and function.get("name")):
                        fail(f"call {index}'s first piece lacks its id, type or name: {delta}", exchange)
                    names.append(function["name"])
                    arguments.append("")
                elif index < len(names):
                    if "name" in function or "id" in delta:
                        fail(f"call {index} is named again by a later piece: {delta}", exchange)
                else:
                    fail(f"a piece of call {index} came before call {len(names)}: {delta}", exchange)
                arguments[index] += function.get("arguments") or ""
    return list(zip(names, arguments)), finish


def assert_calls_agree(streamed: list[Call], full: list[Call], exchange: Exchange) -> None:
    if [name for name, _ in streamed] != [name for name, _ in full]:
        fail(f"the stream calls {[n for n, _ in streamed]}, the non-stream answer {[n for n, _ in full]}", exchange)
    for (name, joined), (_, whole) in zip(streamed, full):
        value = _object(joined)
        if value is None:
            fail(f"{name}'s streamed arguments do not join to a JSON object: {joined[:200]!r}", exchange)
        if value != _object(whole):
            fail(f"{name}'s streamed arguments {joined[:200]!r} differ from the non-stream {whole[:200]!r}", exchange)


def _object(text: str | None) -> dict[str, Any] | None:
    try:
        value = json.loads(text or "")
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def _forced(tool_choice: Any):
    def run(session: Session) -> None:
        body = {**session.probe("chat").base, "tools": [TOOL], "tool_choice": tool_choice,
                "max_tokens": MAX_TOKENS}
        exchange = session.post("chat", {**body, "stream": False})
        if exchange.status != 200:
            skip(f"the server refuses tool_choice {json.dumps(tool_choice)} ({exchange.status})")
        full, finish = non_stream_calls(exchange)
        if _object(full[0][1]) is None:
            fail(f"the forced call's arguments are no JSON object: {full[0][1]!r}", exchange)
        stream = session.stream("chat", body)
        streamed, streamed_finish = streamed_calls(stream)
        assert_calls_agree(streamed, full, stream)
        if streamed_finish != finish:
            fail(f"the stream ends with finish_reason {streamed_finish!r}, the non-stream answer {finish!r}", stream)
    return run


CHECKS = [
    Check(GROUP, "chat required call", "with tool_choice required, the stream's tool-call pieces (each call named "
          "once, with its id, every piece indexed) join to the non-stream calls and finish_reason",
          _forced("required")),
    Check(GROUP, "chat named call", "with the function named in tool_choice, the stream's pieces join to the "
          "non-stream call", _forced({"type": "function", "function": {"name": "get_weather"}})),
]
