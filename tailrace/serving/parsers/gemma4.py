"""Gemma 4's tool calls, in the notation its chat template writes:

    <|tool_call>call:get_weather{city:<|"|>Paris<|"|>,days:3}<tool_call|>

Keys are bare (or quoted, inside nested objects), strings sit between `<|"|>` marks with nothing
escaped, and numbers, true, false, objects `{k:v}` and arrays `[a,b]` are as in JSON. A call's
name goes out once `call:NAME{` is complete; its arguments go out a parameter at a time, as the
JSON object of the values read, so the pieces join to the same text however the answer was split.

The markers are special tokens: the serving layer keeps special tokens in the text for this parser.
"""

from __future__ import annotations

import json
from typing import Any

from tailrace.serving.parsers import (WHITESPACE, BufferedParser, KeyedArguments, Parsed, TextOutsideCalls,
                                      ToolCallDelta)

TOOL_CALL_START = "<|tool_call>"
TOOL_CALL_END = "<tool_call|>"
CALL = "call:"
QUOTE = '<|"|>'


class Gemma4ToolParser(BufferedParser):
    """Text is content until `<|tool_call>`; what follows it that is no `call:NAME{` goes out as
    content as written."""

    def __init__(self) -> None:
        self._state = "text"  # text | name | key | value | closing
        self._text = TextOutsideCalls(TOOL_CALL_START)
        self._index = 0
        self._arguments = KeyedArguments(0)
        self._key = ""

    def _end(self, out: Parsed) -> None:
        if self._state == "text":
            self._text.end(self._buffer, out)
        elif self._state == "name":
            self._text.no_call(out, self._buffer)
        elif self._state in ("key", "value"):  # cut off inside the call: close what was written
            if self._state == "value":
                self._add_argument(self._buffer, out)
            self._close_call(out)

    def _in_text(self, out: Parsed) -> bool:
        return self._read_text(out, "name")

    def _in_name(self, out: Parsed) -> bool:
        at = self._buffer.find("{")
        if at < 0 and (self._buffer.startswith(CALL) or CALL.startswith(self._buffer)):
            return False  # the name may be arriving
        header = self._buffer[:max(at, 0)]
        if at < 0 or not header.startswith(CALL) or not header[len(CALL):].strip():
            self._text.no_call(out, self._buffer)  # no call: the tag is text
            self._buffer, self._state = "", "text"
            return True
        out.tool_calls.append(ToolCallDelta(self._index, header[len(CALL):].strip()))
        self._buffer, self._state = self._buffer[at + 1:], "key"
        self._arguments = KeyedArguments(self._index)
        return True

    def _in_key(self, out: Parsed) -> bool:
        """The next argument's key, or the end of the arguments."""
        rest = self._buffer.lstrip(WHITESPACE + ",")
        if rest.startswith("}"):
            self._buffer = rest[1:]
            self._close_call(out)
            return True
        at = rest.find(":")
        if at < 0:
            self._buffer = rest
            return False
        self._key, self._buffer, self._state = _unquoted(rest[:at].strip()), rest[at + 1:], "value"
        return True

    def _in_value(self, out: Parsed) -> bool:
        end = value_end(self._buffer)
        if end is None:
            return False
        self._add_argument(self._buffer[:end], out)
        self._buffer, self._state = self._buffer[end:], "key"
        return True

    def _in_closing(self, out: Parsed) -> bool:
        return self._read_closing(TOOL_CALL_END)

    def _add_argument(self, text: str, out: Parsed) -> None:
        out.tool_calls.append(self._arguments.add(self._key, gemma_value(text)))

    def _close_call(self, out: Parsed) -> None:
        out.tool_calls.append(self._arguments.close())
        self._index += 1
        self._state = "closing"
        self._text.after_call = True


def value_end(text: str) -> int | None:
    """Where the value `text` starts with ends: at the `,` or `}` that follows it outside strings,
    brackets and braces; None while it may go on."""
    depth, i = 0, 0
    while i < len(text):
        if text.startswith(QUOTE, i):
            close = text.find(QUOTE, i + len(QUOTE))
            if close < 0:
                return None
            i = close + len(QUOTE)
            continue
        ch = text[i]
        if ch in "{[":
            depth += 1
        elif ch in "]}" and depth:
            depth -= 1
        elif ch in ",}" and not depth:
            return i
        i += 1
    return None


def gemma_value(text: str) -> Any:
    """A value in Gemma 4's notation as the JSON value it stands for; text that is none of its
    forms stays a string."""
    try:
        value, rest = _parse(text.strip())
    except ValueError:
        return text.strip()
    return value if not rest.strip() else text.strip()


def _parse(text: str) -> tuple[Any, str]:
    """The value `text` starts with, and what follows it."""
    if text.startswith(QUOTE):
        close = text.find(QUOTE, len(QUOTE))
        if close < 0:  # the answer was cut off inside it
            return text[len(QUOTE):], ""
        return text[len(QUOTE):close], text[close + len(QUOTE):]
    if text.startswith(("{", "[")):
        return _parse_container(text)
    if not text:
        raise ValueError("a value is missing")
    end = min([i for i in (text.find(","), text.find("}"), text.find("]")) if i >= 0] or [len(text)])
    scalar = text[:end].strip()
    return {"true": True, "false": False, "null": None, "None": None}.get(scalar, _number_or_text(scalar)), text[end:]


def _parse_container(text: str) -> tuple[Any, str]:
    closing, rest = ("}" if text[0] == "{" else "]"), text[1:].lstrip()
    items: list[Any] = []
    pairs: dict[str, Any] = {}
    while not rest.startswith(closing):
        before = rest
        if closing == "}":
            key_end = rest.find(":")
            if key_end < 0:
                raise ValueError("a key without a value")
            key, rest = _unquoted(rest[:key_end].strip()), rest[key_end + 1:].lstrip()
            pairs[key], rest = _parse(rest)
        else:
            item, rest = _parse(rest)
            items.append(item)
        rest = rest.lstrip().removeprefix(",").lstrip()
        if rest == before or not rest:
            raise ValueError(f"no {closing} where the {'object' if closing == '}' else 'array'} should end")
    return (pairs if closing == "}" else items), rest[1:]


def _unquoted(key: str) -> str:
    return key[len(QUOTE):-len(QUOTE)] if key.startswith(QUOTE) and key.endswith(QUOTE) else key


def _number_or_text(text: str) -> Any:
    try:
        value = json.loads(text)
    except ValueError:
        return text
    return value if isinstance(value, (int, float)) and not isinstance(value, bool) else text
