"""Llama 3.x JSON tool calls: the whole answer is `{"name": "f", "parameters": {...}}`, maybe
after `<|python_tag|>`, and several calls are separated by `;`. An answer that does not start
with `{` is plain content."""

from __future__ import annotations

from tailrace.serving.parsers import WHITESPACE, BufferedParser, Parsed, merge_calls
from tailrace.serving.parsers.json_calls import CallObject

PYTHON_TAG = "<|python_tag|>"


class Llama3JsonToolParser(BufferedParser):
    def __init__(self) -> None:
        self._state = "start"  # start | calls | between | text
        self._skipped = ""  # leading whitespace and tag, given back if the answer is content
        self._call: CallObject | None = None
        self._next_index = 0

    def _end(self, out: Parsed) -> None:
        if self._state in ("start", "text"):
            out.content = self._skipped + self._buffer
        elif self._state == "calls":
            self._call.end()
            out.tool_calls = merge_calls(self._call.take())
            if not self._call.announced:
                out.content = self._given_back(self._call) + self._buffer
        self._skipped = ""

    def _in_between(self, out: Parsed) -> bool:
        rest = self._buffer.lstrip(WHITESPACE + ";")
        if not rest:
            self._buffer = ""
            return False
        self._buffer = rest
        if rest[0] == "{":
            self._state, self._call = "calls", CallObject(self._next_index)
        else:  # text after the calls
            self._state = "text"
        return True

    def _in_text(self, out: Parsed) -> bool:
        out.content += self._buffer
        self._buffer = ""
        return False

    def _in_start(self, out: Parsed) -> bool:
        """Leading whitespace and `<|python_tag|>` are skipped; the first other character decides."""
        stripped = self._buffer.lstrip(WHITESPACE)
        self._skipped += self._buffer[:len(self._buffer) - len(stripped)]
        self._buffer = stripped
        if stripped.startswith(PYTHON_TAG):
            self._skipped += PYTHON_TAG
            self._buffer = stripped[len(PYTHON_TAG):]
            return True
        if not stripped or (PYTHON_TAG.startswith(stripped) and len(stripped) < len(PYTHON_TAG)):
            return False
        if stripped[0] == "{":
            self._state, self._call = "calls", CallObject(self._next_index)
        else:
            self._state = "text"
            out.content += self._skipped
            self._skipped = ""
        return True

    def _in_calls(self, out: Parsed) -> bool:
        call = self._call
        self._read_calls(call, out)
        if call.announced:
            self._next_index, self._skipped = call.index + 1, ""
        if call.is_call:
            self._state = "between"
        elif call.failed or call.done:
            if not call.announced:  # no call after all: the text is content
                out.content += self._given_back(call)
            self._state = "text"
        else:
            return False
        return True

    def _given_back(self, call: CallObject) -> str:
        """A would-be call's text as content; the first one also gives back what `_start` skipped."""
        skipped, self._skipped = self._skipped, ""
        return skipped + call.raw
