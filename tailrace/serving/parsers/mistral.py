"""Mistral tool calls after the `[TOOL_CALLS]` control token, in either of its tokenizers' forms:
a JSON array `[{"name": "f", "arguments": {...}}, ...]` (v3 and earlier), or one
`[TOOL_CALLS]f[ARGS]{...}` per call (v11 and later; a `[CALL_ID]id` before `[ARGS]` is skipped).

`[TOOL_CALLS]` is a special token: the serving layer keeps special tokens in the text for this
parser.
"""

from __future__ import annotations

from tailrace.serving.parsers import WHITESPACE, BufferedParser, Parsed, TextOutsideCalls, ToolCallDelta, merge_calls
from tailrace.serving.parsers.json_calls import CallArray, JsonValue, give_out_arguments

TOOL_CALLS = "[TOOL_CALLS]"
ARGS = "[ARGS]"
CALL_ID = "[CALL_ID]"


class MistralToolParser(BufferedParser):
    def __init__(self) -> None:
        self._state = "text"  # text | after_tag | array | name | args
        self._text = TextOutsideCalls(TOOL_CALLS)
        self._array: CallArray | None = None
        self._args: JsonValue | None = None
        self._next_index = 0

    def _end(self, out: Parsed) -> None:
        if self._state == "text":
            self._text.end(self._buffer, out)
        elif self._state in ("after_tag", "name"):
            out.content = TOOL_CALLS + self._buffer  # the tag led to no call
        elif self._state == "array":
            self._array.end()
            out.tool_calls = merge_calls(self._array.take())
            if not self._announced_any(self._array):
                out.content = TOOL_CALLS + self._array.raw + self._buffer

    def _in_text(self, out: Parsed) -> bool:
        return self._read_text(out, "after_tag")

    def _in_after_tag(self, out: Parsed) -> bool:
        self._buffer = self._buffer.lstrip(WHITESPACE)
        if not self._buffer:
            return False
        if self._buffer[0] == "[":
            self._state, self._array = "array", CallArray(self._next_index)
        else:
            self._state = "name"
        return True

    def _in_array(self, out: Parsed) -> bool:
        array = self._array
        self._read_calls(array, out)
        if array.done:
            self._next_index, self._text.after_call, self._state = array.next_index, True, "text"
        elif array.failed:
            if self._announced_any(array):
                self._next_index = max(c.index for c in array.calls if c.announced) + 1
            else:  # no call after all: the text is content
                self._text.emit(out, TOOL_CALLS + array.raw)
            self._state = "text"
        else:
            return False
        return True

    def _in_name(self, out: Parsed) -> bool:
        at = self._buffer.find(ARGS)
        if at < 0:
            return False
        name = self._buffer[:at].split(CALL_ID)[0].strip(WHITESPACE)
        self._buffer = self._buffer[at + len(ARGS):].lstrip(WHITESPACE)
        out.tool_calls.append(ToolCallDelta(self._next_index, name))
        self._state, self._args = "args", JsonValue()
        return True

    def _in_args(self, out: Parsed) -> bool:
        self._buffer = give_out_arguments(self._args, self._buffer, self._next_index, out)
        if not self._args.done:
            return False
        self._next_index += 1
        self._state, self._text.after_call = "text", True
        return True

    @staticmethod
    def _announced_any(array: CallArray) -> bool:
        return any(call.announced for call in array.calls)
