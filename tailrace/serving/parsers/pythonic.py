"""Pythonic tool calls (Llama 3.2 and 4, and others' templates): the whole answer is a Python list
of calls with keyword arguments, `[get_weather(city="Paris", days=3), get_time()]`, in Llama 4
maybe between `<|python_start|>` and `<|python_end|>`. An answer that does not start with `[`
is plain content.

A call's name goes out at its `(`, and each argument once its value is complete: the value is a
Python literal, turned into JSON (`True` -> true, `None` -> null, tuples -> arrays). The pieces
join to `{"KEY": value, ...}` however the answer was split.
"""

from __future__ import annotations

import ast

from tailrace.serving.parsers import WHITESPACE, KeyedArguments, Parsed, ToolCallDelta

PYTHON_START = "<|python_start|>"
PYTHON_END = "<|python_end|>"
_NAME_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_.-")
_OPENERS, _CLOSERS = "([{", ")]}"


class PythonicToolParser:
    def __init__(self) -> None:
        self._buffer = ""
        self._raw = ""  # what was read before the first call went out, given back if there is none
        self._state = "start"  # start | list | name | key | value | after_call | done | text
        self._index = 0  # of the current call
        self._open = False  # a call is given out and not yet closed
        self._arguments = KeyedArguments(0)
        self._token = ""  # the name, key or value being read
        self._key = ""
        self._value = _Literal()

    def feed(self, text: str) -> Parsed:
        self._buffer += text
        out = Parsed()
        buffer, i = self._buffer, 0
        while i < len(buffer) and self._state != "text":
            j = self._advance(buffer, i, out)
            if j is None:
                break  # a tag may be arriving
            if not self._index and not self._open and self._state != "text":
                self._raw += buffer[i:j]
            i = j
        if self._state == "text":
            out.content += buffer[i:]
            i = len(buffer)
        self._buffer = buffer[i:]
        return out

    def finish(self) -> Parsed:
        out = Parsed()
        if self._state == "value" and self._end_value(out):
            self._state = "key"
        if self._state in ("key", "value"):
            self._close_call(out)  # cut off: the call ends with the text
        elif self._state in ("start", "list", "name"):
            self._give_back(out)
            out.content += self._buffer
        elif self._state == "text":
            out.content += self._buffer
        self._buffer = ""
        return out

    def _advance(self, buffer: str, i: int, out: Parsed) -> int | None:
        """Where reading buffer[i:] in the current state got to (i itself: the state changed);
        None: wait for more text."""
        ch, state = buffer[i], self._state
        if state == "value":
            used = self._value.feed(buffer[i:])
            self._token += buffer[i:i + used]
            if self._value.done:
                if self._end_value(out):
                    self._state = "key"
                else:
                    self._give_back(out)
            return i + used
        if ch in WHITESPACE and state != "name":
            if state != "done":
                return i + 1
            return None if not buffer[i:].strip(WHITESPACE) else self._to_text(i)
        if state == "start":
            return self._start(buffer, i, out)
        if state == "list" and ch in _NAME_CHARS:
            self._state, self._token = "name", ""
            return i
        if state == "name":
            return self._name(ch, i, out)
        if state == "key":
            return self._key_char(ch, i, out)
        if state == "after_call" and ch in ",]":
            self._state = "list" if ch == "," else "done"
            return i + 1
        if state == "done":
            rest = buffer[i:]
            if rest.startswith(PYTHON_END):
                return i + len(PYTHON_END)
            return None if PYTHON_END.startswith(rest) else self._to_text(i)
        self._give_back(out)
        return i

    def _start(self, buffer: str, i: int, out: Parsed) -> int | None:
        rest = buffer[i:]
        if rest.startswith(PYTHON_START):
            return i + len(PYTHON_START)
        if PYTHON_START.startswith(rest):
            return None
        if rest[0] == "[":
            self._state = "list"
            return i + 1
        self._give_back(out)
        return i

    def _name(self, ch: str, i: int, out: Parsed) -> int:
        if ch in _NAME_CHARS:
            self._token += ch
            return i + 1
        if ch == "(" and self._token:
            out.tool_calls.append(ToolCallDelta(self._index, self._token, ""))
            self._raw, self._state, self._token, self._open = "", "key", "", True
            self._arguments = KeyedArguments(self._index)
            return i + 1
        self._give_back(out)
        return i

    def _key_char(self, ch: str, i: int, out: Parsed) -> int:
        if ch == "," and not self._token and self._arguments.written:
            return i + 1
        if ch == ")" and not self._token:
            self._close_call(out)
            return i + 1
        if ch in _NAME_CHARS:
            self._token += ch
            return i + 1
        if ch == "=" and self._token:
            self._key, self._token, self._state, self._value = self._token, "", "value", _Literal()
            return i + 1
        self._give_back(out)
        return i

    def _to_text(self, i: int) -> int:
        """Text after the calls is content."""
        self._state = "text"
        return i

    def _give_back(self, out: Parsed) -> None:
        """No (more) calls: what was read before any call went out is content, and so is the rest;
        a call given out ends where it broke off."""
        if self._open:
            self._close_call(out)
        out.content += self._raw
        self._raw, self._state = "", "text"

    def _end_value(self, out: Parsed) -> bool:
        try:
            value = ast.literal_eval(self._token.strip())
        except (ValueError, SyntaxError, RecursionError):
            return False
        out.tool_calls.append(self._arguments.add(self._key, value))
        self._token = ""
        return True

    def _close_call(self, out: Parsed) -> None:
        out.tool_calls.append(self._arguments.close())
        self._index += 1
        self._open, self._state = False, "after_call"


class _Literal:
    """A Python literal read a character at a time: done at the `,` or `)` that follows it at depth 0
    (not taken)."""

    __slots__ = ("depth", "quote", "escaped", "done")

    def __init__(self) -> None:
        self.depth = 0
        self.quote = ""
        self.escaped = False
        self.done = False

    def feed(self, text: str) -> int:
        for i, ch in enumerate(text):
            if self.quote:
                if self.escaped:
                    self.escaped = False
                elif ch == "\\":
                    self.escaped = True
                elif ch == self.quote:
                    self.quote = ""
            elif ch in "'\"":
                self.quote = ch
            elif ch in _OPENERS:
                self.depth += 1
            elif ch in _CLOSERS and self.depth:
                self.depth -= 1
            elif ch in ",)" and not self.depth:
                self.done = True
                return i
        return len(text)
