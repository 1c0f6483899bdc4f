"""Qwen3-Coder and Qwen3.5 tool calls, written as XML with unquoted values:

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    </function>
    </tool_call>

A value is the text between `<parameter=KEY>` and `</parameter>` without the one newline the
template puts on each side, typed by the tool's JSON schema for KEY (`typed_value`). A call's
name goes out once `<function=NAME>` is complete; its arguments go out a parameter at a time,
as the JSON object `{"KEY": value, ...}` built from the parsed values, so the pieces join to
the same text however the answer was split.
"""

from __future__ import annotations

import ast
import json
from typing import Any

from tailrace.serving.parsers import (WHITESPACE, BufferedParser, KeyedArguments, Parsed, TextOutsideCalls,
                                      ToolCallDelta, ToolSchemas)

TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"
FUNCTION_START = "<function="
FUNCTION_END = "</function>"
PARAMETER_START = "<parameter="
PARAMETER_END = "</parameter>"
_STRING_TYPES = ("string", "str", "text", "varchar", "char", "enum")


class Qwen3XmlToolParser(BufferedParser):
    """Text is content until `<tool_call>`; a block that is no `<function=...>` call goes out as
    content as written; whitespace between blocks is dropped."""

    def __init__(self, tools: ToolSchemas) -> None:
        self._tools = tools
        self._state = "text"  # text | function | name | body | value | closing
        self._text = TextOutsideCalls(TOOL_CALL_START, FUNCTION_START)
        self._raw = ""  # the current block's text, given back as content if it is no call
        self._name = ""
        self._key = ""
        self._arguments = KeyedArguments(0)
        self._index = 0

    def _end(self, out: Parsed) -> None:
        if self._state == "text":
            self._text.end(self._buffer, out)
        elif self._state in ("function", "name"):  # no call announced: the block is text
            self._text.no_call(out, self._raw + self._buffer)
        elif self._state in ("body", "value"):  # cut off inside the call: close what was written
            if self._state == "value":
                self._add_parameter(self._buffer, out)
            self._close_call(out)

    def _in_text(self, out: Parsed) -> bool:
        if not self._read_text(out, "function"):
            return False
        if self._text.found == FUNCTION_START:  # a call too: models drop the <tool_call> wrapper
            self._state = "name"
        self._raw = ""
        return True

    def _in_closing(self, out: Parsed) -> bool:
        return self._read_closing(TOOL_CALL_END)

    def _take(self, count: int) -> str:
        taken, self._buffer = self._buffer[:count], self._buffer[count:]
        self._raw += taken
        return taken

    def _in_function(self, out: Parsed) -> bool:
        rest = self._buffer.lstrip(WHITESPACE)
        if FUNCTION_START.startswith(rest) and len(rest) < len(FUNCTION_START):
            return False  # the tag may be arriving
        self._take(len(self._buffer) - len(rest))
        if not rest.startswith(FUNCTION_START):  # no call: the block is text
            self._text.no_call(out, self._raw)
            self._state = "text"
            return True
        self._take(len(FUNCTION_START))
        self._state = "name"
        return True

    def _in_name(self, out: Parsed) -> bool:
        at = self._buffer.find(">")
        if at < 0:
            return False
        self._name = self._take(at + 1)[:-1].strip()
        self._arguments = KeyedArguments(self._index)
        out.tool_calls.append(ToolCallDelta(self._index, self._name, ""))
        self._state = "body"
        return True

    def _in_body(self, out: Parsed) -> bool:
        """Between parameters: the next one, or the function's end."""
        rest = self._buffer.lstrip(WHITESPACE)
        if any(tag.startswith(rest) and len(rest) < len(tag) for tag in (PARAMETER_START, FUNCTION_END)):
            return False  # a tag may be arriving
        self._take(len(self._buffer) - len(rest))
        if rest.startswith(PARAMETER_START):
            at = rest.find(">")
            if at < 0:
                return False
            self._key = self._take(at + 1)[len(PARAMETER_START):-1].strip()
            self._state = "value"
            return True
        if rest.startswith(FUNCTION_END):
            self._take(len(FUNCTION_END))
        # The function's end, or text where it should be (forgiven): the call is complete.
        self._close_call(out)
        self._state = "closing"
        return True

    def _in_value(self, out: Parsed) -> bool:
        at = self._buffer.find(PARAMETER_END)
        if at < 0:
            return False
        value = self._take(at + len(PARAMETER_END))[:-len(PARAMETER_END)]
        self._add_parameter(value, out)
        self._state = "body"
        return True

    def _add_parameter(self, value: str, out: Parsed) -> None:
        value = value.removeprefix("\n").removesuffix("\n")
        typed = typed_value(value, self._tools.get(self._name, {}).get("properties", {}).get(self._key))
        out.tool_calls.append(self._arguments.add(self._key, typed))

    def _close_call(self, out: Parsed) -> None:
        out.tool_calls.append(self._arguments.close())
        self._index += 1
        self._text.after_call = True



def typed_value(text: str, schema: dict[str, Any] | None) -> Any:
    """A parameter's text as the value its schema declares: strings as written; numbers,
    booleans, objects and arrays parsed (as JSON, or as a Python literal, which models also
    write); `null` as null. Text that does not parse as its type stays a string, and so does a
    parameter the schema does not declare."""
    if schema is None:
        return text
    kinds = schema.get("type", "string")
    kinds = [kinds] if isinstance(kinds, str) else list(kinds)
    if text.strip().lower() == "null" and ("null" in kinds or not any(k in _STRING_TYPES for k in kinds)):
        return None
    if any(k in _STRING_TYPES for k in kinds):
        return text
    stripped = text.strip()
    if "boolean" in kinds and stripped.lower() in ("true", "false"):
        return stripped.lower() == "true"
    for parse in (json.loads, ast.literal_eval):
        try:
            value = parse(stripped)
        except (ValueError, SyntaxError, RecursionError):
            continue
        if _has_kind(value, kinds):
            return value
    return text


def _has_kind(value: Any, kinds: list[str]) -> bool:
    checks = {"integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
              "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
              "boolean": lambda v: isinstance(v, bool), "object": lambda v: isinstance(v, dict),
              "array": lambda v: isinstance(v, list)}
    return any(checks.get(kind, lambda v: False)(value) for kind in kinds)
