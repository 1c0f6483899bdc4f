"""Tool calls as JSON after a tag: Phi-4-mini's `<|tool_call|>[{...}, ...]<|/tool_call|>` and
Granite 3's `<|tool_call|>[{...}, ...]` (no closing tag), each call `{"name": ..., "arguments":
{...}}`; a single object is read as well as an array.

The tags are special tokens: the serving layer keeps special tokens in the text for this parser.
"""

from __future__ import annotations

from tailrace.serving.parsers import WHITESPACE, BufferedParser, Parsed, TextOutsideCalls, merge_calls
from tailrace.serving.parsers.json_calls import CallArray, CallObject

TOOL_CALL_START = "<|tool_call|>"
TOOL_CALL_END = "<|/tool_call|>"


class TaggedJsonToolParser(BufferedParser):
    """Text is content until the tag; what follows it that is no call goes out as content as
    written. A closing tag after the calls is read where the format has one and forgiven where
    it is missing."""

    def __init__(self, start: str = TOOL_CALL_START, end: str | None = TOOL_CALL_END) -> None:
        self._start, self._closing = start, end
        self._state = "text"  # text | after_tag | calls | closing
        self._text = TextOutsideCalls(start)
        self._calls: CallArray | CallObject | None = None
        self._next_index = 0

    def _end(self, out: Parsed) -> None:
        if self._state == "text":
            self._text.end(self._buffer, out)
        elif self._state == "after_tag":
            self._text.no_call(out, self._buffer)  # the tag led to no call
        elif self._state == "calls":
            self._calls.end()
            out.tool_calls = merge_calls(self._calls.take())
            if not self._announced():
                self._text.no_call(out, self._calls.raw + self._buffer)

    def _in_text(self, out: Parsed) -> bool:
        return self._read_text(out, "after_tag")

    def _in_after_tag(self, out: Parsed) -> bool:
        rest = self._buffer.lstrip(WHITESPACE)
        if not rest:
            return False
        if rest[0] not in "[{":  # no call: the tag is text
            self._text.no_call(out, self._buffer)
            self._buffer, self._state = "", "text"
            return True
        self._buffer = rest
        self._calls = CallArray(self._next_index) if rest[0] == "[" else CallObject(self._next_index)
        self._state = "calls"
        return True

    def _in_closing(self, out: Parsed) -> bool:
        return self._read_closing(self._closing)

    def _in_calls(self, out: Parsed) -> bool:
        calls = self._calls
        self._read_calls(calls, out)
        complete = calls.done and (isinstance(calls, CallArray) or calls.is_call)
        if complete or calls.failed or calls.done:
            if self._announced():
                self._next_index = max(d.index for d in self._announced_calls()) + 1
                self._text.after_call = True
            else:  # no call after all: the text is content
                self._text.no_call(out, calls.raw)
            self._state = "closing" if complete and self._closing else "text"
            return True
        return False

    def _announced_calls(self) -> list[CallObject]:
        calls = self._calls.calls if isinstance(self._calls, CallArray) else [self._calls]
        return [call for call in calls if call.announced]

    def _announced(self) -> bool:
        return bool(self._announced_calls())
