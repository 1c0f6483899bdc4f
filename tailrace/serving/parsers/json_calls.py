"""Tool calls written as JSON (`{"name": ..., "arguments": {...}}`, or an array of them), read a
character at a time so that a call's name goes out as soon as it is complete and its arguments
as they are written.

Only the nesting is followed (brackets outside strings, escapes inside them): that is all it
takes to know where a value ends. The arguments text is passed on exactly as the model wrote
it, so streamed fragments join to exactly the non-streamed arguments.
"""

from __future__ import annotations

import json

from tailrace.serving.parsers import WHITESPACE, Parsed, ToolCallDelta

ARGUMENT_KEYS = ("arguments", "parameters")


class JsonValue:
    """One JSON value (no leading whitespace) read in pieces; `done` after its last character."""

    __slots__ = ("kind", "depth", "in_string", "escaped", "done")

    def __init__(self) -> None:
        self.kind: str | None = None  # '{', '[', '"', or "scalar"
        self.depth = 0
        self.in_string = False
        self.escaped = False
        self.done = False

    def feed(self, text: str) -> int:
        """How many characters of `text` belong to the value; fewer than all means it ended."""
        for i, ch in enumerate(text):
            if self.kind is None:
                self.kind = ch if ch in '{["' else "scalar"
                self.depth = 1 if ch in "{[" else 0
                self.in_string = ch == '"'
            elif self.kind == "scalar":
                if ch in WHITESPACE or ch in ",}]":  # a number or literal ends at what follows it
                    self.done = True
                    return i
            elif self.in_string:
                if self.escaped:
                    self.escaped = False
                elif ch == "\\":
                    self.escaped = True
                elif ch == '"':
                    self.in_string = False
                    if self.kind == '"':
                        self.done = True
                        return i + 1
            elif ch == '"':
                self.in_string = True
            elif ch in "{[":
                self.depth += 1
            elif ch in "}]":
                self.depth -= 1
                if self.depth == 0:
                    self.done = True
                    return i + 1
        return len(text)

    def end(self) -> None:
        """The text ended: a scalar ends with it (anything else stays unfinished)."""
        if self.kind == "scalar":
            self.done = True


def give_out_arguments(value: JsonValue, buffer: str, index: int, out: Parsed) -> str:
    """Call `index`'s arguments, written as one JSON value: the part of `buffer` that belongs to
    it goes to `out` as written (whitespace before it dropped); what follows it is returned."""
    if value.kind is None:
        buffer = buffer.lstrip(WHITESPACE)
    used = value.feed(buffer)
    out.tool_calls.append(ToolCallDelta(index, None, buffer[:used]))
    return buffer[used:]


class CallObject:
    """One `{"name": "f", "arguments": {...}}` object (`parameters` is read as `arguments`).

    `take()` gives its pieces so far: nothing until the name is complete, then the name with the
    arguments written up to then, then argument fragments. Arguments written as a JSON string
    (some models do) are passed on decoded, once the string is complete.
    """

    def __init__(self, index: int) -> None:
        self.index = index
        self.raw = ""  # every character read, for giving the text back when it was no call
        self.state = "open"
        self.failed = False
        self.name: str | None = None
        self.announced = False  # the name piece went out
        self._key_raw = ""
        self._key_escaped = False
        self._key: str | None = None
        self._value: JsonValue | None = None
        self._value_raw = ""
        self._arguments_seen = False
        self._pending = ""  # arguments text not taken yet

    @property
    def done(self) -> bool:
        return self.state == "done"

    def feed(self, text: str) -> int:
        """Characters read from `text`: all of them, or up to the object's end, or up to the
        character that shows it is no call object (then `failed` is set)."""
        i = 0
        while i < len(text) and not self.done and not self.failed:
            if self.state == "value":
                used = self._value.feed(text[i:])
                self._take_value_text(text[i:i + used])
                i += used
                if self._value.done:
                    self._end_value()
                continue
            if not self._step(text[i]):
                self.failed = True
                break
            i += 1
        self.raw += text[:i]
        return i

    def end(self) -> None:
        """The text ended: a scalar value in progress is complete."""
        if self.state == "value" and not self.failed:
            self._value.end()
            if self._value.done:
                self._end_value()

    def _step(self, ch: str) -> bool:
        """One character between values; False when it cannot be there."""
        state = self.state
        if state == "key":
            if self._key_escaped:
                self._key_escaped = False
            elif ch == "\\":
                self._key_escaped = True
            elif ch == '"':
                self._key = _loads(self._key_raw + ch)
                self.state = "colon"
                return isinstance(self._key, str)
            self._key_raw += ch
            return True
        if ch in WHITESPACE:
            return True
        if state == "open" and ch == "{":
            self.state = "key_or_end"
        elif state == "key_or_end" and ch == '"':
            self._key_raw, self.state = ch, "key"
        elif state in ("key_or_end", "comma_or_end") and ch == "}":
            self.state = "done"
            if not self._arguments_seen:
                self._pending += "{}"  # a call without arguments takes none: still a JSON object
        elif state == "comma_or_end" and ch == ",":
            self.state = "key_or_end"
        elif state == "colon" and ch == ":":
            self.state = "before_value"
        elif state == "before_value":
            self._value, self._value_raw, self.state = JsonValue(), "", "value"
            used = self._value.feed(ch)
            self._take_value_text(ch[:used])
            if self._value.done:
                self._end_value()
        else:
            return False
        return True

    def _is_arguments(self) -> bool:
        return self._key in ARGUMENT_KEYS and not self._arguments_seen

    def _take_value_text(self, text: str) -> None:
        if self._is_arguments() and self._value.kind in "{[":
            self._pending += text  # objects and arrays stream as written
        else:
            self._value_raw += text

    def _end_value(self) -> None:
        if self._key == "name":
            self.name = _loads(self._value_raw)
            if not isinstance(self.name, str):
                self.name, self.failed = None, True
        elif self._is_arguments():
            if self._value.kind == '"':
                decoded = _loads(self._value_raw)
                self._pending += decoded if isinstance(decoded, str) else self._value_raw
            elif self._value.kind == "scalar":
                self._pending += self._value_raw
            self._arguments_seen = True
        self.state = "comma_or_end"

    def take(self) -> list[ToolCallDelta]:
        if self.name is None:
            return []
        if not self.announced:
            self.announced = True
            arguments, self._pending = self._pending, ""
            return [ToolCallDelta(self.index, self.name, arguments)]
        if not self._pending:
            return []
        fragment, self._pending = self._pending, ""
        return [ToolCallDelta(self.index, None, fragment)]

    @property
    def is_call(self) -> bool:
        """Complete, and a call: a name was found."""
        return self.done and self.name is not None


class CallArray:
    """`[{call}, {call}, ...]`: Mistral's array format, and what tool_choice "required" makes the
    model write. Calls are numbered from `first_index` in the order they appear."""

    def __init__(self, first_index: int = 0) -> None:
        self.state = "open"
        self.failed = False
        self.raw = ""
        self.calls: list[CallObject] = []
        self._next_index = first_index

    @property
    def done(self) -> bool:
        return self.state == "done"

    def feed(self, text: str) -> int:
        i = 0
        while i < len(text) and not self.done and not self.failed:
            if self.state == "item":
                call = self.calls[-1]
                i += call.feed(text[i:])
                if call.failed or (call.done and not call.is_call):
                    self.failed = True
                elif call.done:
                    self.state = "comma_or_end"
                continue
            ch = text[i]
            if ch in WHITESPACE:
                pass
            elif self.state == "open" and ch == "[":
                self.state = "item_or_end"
            elif self.state in ("item_or_end", "comma_or_end") and ch == "]":
                self.state = "done"
            elif self.state == "comma_or_end" and ch == ",":
                self.state = "item_or_end"
            elif self.state == "item_or_end" and ch == "{":
                self.calls.append(CallObject(self._next_index))
                self._next_index += 1
                self.state = "item"
                continue  # the object reads its own brace
            else:
                self.failed = True
                break
            i += 1
        self.raw += text[:i]
        return i

    def end(self) -> None:
        if self.calls:
            self.calls[-1].end()

    def take(self) -> list[ToolCallDelta]:
        return [piece for call in self.calls for piece in call.take()]

    @property
    def next_index(self) -> int:
        return self._next_index


def _loads(text: str) -> object:
    try:
        return json.loads(text)
    except ValueError:
        return None
