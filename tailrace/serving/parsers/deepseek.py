"""DeepSeek V3 / R1 and V3.1 tool calls, between their special tokens:

    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME
    ```json
    {"city": "Paris"}
    ```<｜tool▁call▁end｜><｜tool▁calls▁end｜>

V3.1 writes `<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{...}<｜tool▁call▁end｜>`. A call's name goes out
once it is complete and its arguments as they are written.

The markers are special tokens: the serving layer keeps special tokens in the text for this parser.
"""

from __future__ import annotations

from tailrace.serving.parsers import WHITESPACE, BufferedParser, Parsed, TextOutsideCalls, ToolCallDelta
from tailrace.serving.parsers.json_calls import JsonValue, give_out_arguments

CALLS_BEGIN = "<｜tool▁calls▁begin｜>"
CALLS_END = "<｜tool▁calls▁end｜>"
CALL_BEGIN = "<｜tool▁call▁begin｜>"
CALL_END = "<｜tool▁call▁end｜>"
SEP = "<｜tool▁sep｜>"
FENCE = "```"


class DeepSeekToolParser(BufferedParser):
    def __init__(self) -> None:
        self._state = "text"  # text | calls | header | name | fence | arguments | fence_end | call_end
        self._text = TextOutsideCalls(CALLS_BEGIN)
        self._fenced = False  # V3's form: the arguments in a ```json fence
        self._arguments = JsonValue()
        self._index = 0
        self._open = False  # a call's name is out and its arguments are not complete

    def _end(self, out: Parsed) -> None:
        if self._state == "text":
            self._text.end(self._buffer, out)
        elif self._open and self._arguments.kind is None:  # cut off before the arguments: none
            out.tool_calls.append(ToolCallDelta(self._index, None, "{}"))

    def _in_text(self, out: Parsed) -> bool:
        return self._read_text(out, "calls")

    def _in_fence(self, out: Parsed) -> bool:
        return self._expect(FENCE + "json", "arguments", skip_line=True)

    def _in_fence_end(self, out: Parsed) -> bool:
        return self._expect(FENCE, "call_end")

    def _in_call_end(self, out: Parsed) -> bool:
        return self._expect(CALL_END, "calls")

    def _in_calls(self, out: Parsed) -> bool:
        """Between calls: the next one, or the end of them."""
        rest = self._buffer.lstrip(WHITESPACE)
        for tag, state in ((CALL_BEGIN, "header"), (CALLS_END, "text")):
            if rest.startswith(tag):
                self._buffer, self._state = rest[len(tag):], state
                self._text.after_call = True
                return True
        if any(tag.startswith(rest) for tag in (CALL_BEGIN, CALLS_END)):
            self._buffer = rest
            return False
        self._buffer, self._state = rest, "text"  # a missing end marker is forgiven
        return True

    def _in_header(self, out: Parsed) -> bool:
        """`function` (V3, R1: the name follows the separator) or the name itself (V3.1)."""
        at = self._buffer.find(SEP)
        if at < 0:
            return False
        header, self._buffer = self._buffer[:at].strip(WHITESPACE), self._buffer[at + len(SEP):]
        self._fenced = header == "function"
        if self._fenced:
            self._state = "name"
        else:
            self._announce(header, out)
            self._state = "arguments"
        return True

    def _in_name(self, out: Parsed) -> bool:
        at = self._buffer.find("\n")
        if at < 0:
            return False
        self._announce(self._buffer[:at].strip(WHITESPACE), out)
        self._buffer, self._state = self._buffer[at + 1:], "fence"
        return True

    def _announce(self, name: str, out: Parsed) -> None:
        out.tool_calls.append(ToolCallDelta(self._index, name))
        self._open, self._arguments = True, JsonValue()

    def _expect(self, tag: str, state: str, skip_line: bool = False) -> bool:
        """Pass `tag` (forgiven where it is missing) on the way to `state`; with skip_line, the
        rest of its line too."""
        rest = self._buffer.lstrip(WHITESPACE)
        arriving = tag.startswith(rest) and len(rest) < len(tag)
        if arriving or (skip_line and rest.startswith(tag) and "\n" not in rest):
            return False  # the tag (or its line) may be arriving
        if rest.startswith(tag):
            rest = rest[len(tag):]
            if skip_line:
                rest = rest[rest.find("\n") + 1:]
        self._buffer, self._state = rest, state
        return True

    def _in_arguments(self, out: Parsed) -> bool:
        self._buffer = give_out_arguments(self._arguments, self._buffer, self._index, out)
        if not self._arguments.done:
            return False
        self._index += 1
        self._open = False
        self._state = "fence_end" if self._fenced else "call_end"
        return True
