"""Tool calls the grammar forced (tool_choice "required" or a named function): the answer is
JSON the server asked for, so reading it needs no guessing."""

from __future__ import annotations

from tailrace.serving.parsers import Parsed, ToolCallDelta, merge_calls
from tailrace.serving.parsers.json_calls import CallArray


class NamedCallParser:
    """tool_choice naming a function: the whole answer is that function's arguments object."""

    def __init__(self, name: str) -> None:
        self._name: str | None = name  # None once announced

    def feed(self, text: str) -> Parsed:
        name, self._name = self._name, None
        return Parsed(tool_calls=merge_calls([ToolCallDelta(0, name, text)]))

    def finish(self) -> Parsed:
        return self.feed("") if self._name is not None else Parsed()


class RequiredCallsParser:
    """tool_choice "required": the answer is `[{"name": ..., "parameters": {...}}, ...]`."""

    def __init__(self) -> None:
        self._array = CallArray()
        self._rest = ""  # text after the array; the grammar allows none, so this stays empty

    def feed(self, text: str) -> Parsed:
        if self._array.done or self._array.failed:
            self._rest += text
            return Parsed()
        used = self._array.feed(text)
        self._rest += text[used:]
        return Parsed(tool_calls=merge_calls(self._array.take()))

    def finish(self) -> Parsed:
        self._array.end()
        return Parsed(content=self._rest, tool_calls=merge_calls(self._array.take()))
