"""Hermes / Qwen tool calls: `<tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>`,
one block per call, after any text the model writes first."""

from __future__ import annotations

from tailrace.serving.parsers import BufferedParser, Parsed, TextOutsideCalls, merge_calls
from tailrace.serving.parsers.json_calls import CallObject

TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"


class HermesToolParser(BufferedParser):
    """Text is content until `<tool_call>`; a block whose body is no call object goes out as
    content as written; whitespace between blocks is dropped."""

    def __init__(self) -> None:
        self._state = "text"  # text | call | closing | skip
        self._text = TextOutsideCalls(TOOL_CALL_START)
        self._call: CallObject | None = None
        self._next_index = 0

    def _end(self, out: Parsed) -> None:
        if self._state == "text":
            self._text.end(self._buffer, out)
        elif self._state == "call":
            self._call.end()
            out.tool_calls = merge_calls(self._call.take())
            if not self._call.announced:
                self._text.no_call(out, self._call.raw + self._buffer)

    def _in_text(self, out: Parsed) -> bool:
        if not self._read_text(out, "call"):
            return False
        self._call = CallObject(self._next_index)
        return True

    def _in_call(self, out: Parsed) -> bool:
        call = self._call
        self._read_calls(call, out)
        if call.announced:
            self._next_index = call.index + 1
        if call.is_call:
            self._state, self._text.after_call = "closing", True
        elif call.failed or call.done:
            if call.announced:
                self._state = "skip"
            else:  # no call after all: the block is text
                self._text.no_call(out, call.raw)
                self._state = "text"
        else:
            return False
        return True

    def _in_closing(self, out: Parsed) -> bool:
        return self._read_closing(TOOL_CALL_END)

    def _in_skip(self, out: Parsed) -> bool:
        """The rest of a block that broke after its call was announced."""
        at = self._buffer.find(TOOL_CALL_END)
        if at < 0:
            self._buffer = self._buffer[len(self._buffer) - len(TOOL_CALL_END) + 1:]
            return False
        self._buffer, self._state = self._buffer[at + len(TOOL_CALL_END):], "text"
        return True
