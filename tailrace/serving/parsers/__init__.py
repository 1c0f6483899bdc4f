"""Incremental parsers for what a model writes into its answer: thinking, and tool calls in the
formats real models emit. Each is a small state machine fed text deltas; one object per choice.

Every parser keeps the rule that makes streaming exact: feeding a text in any number of pieces
gives the same joined result as feeding it whole, so a stream and its non-stream response agree.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

WHITESPACE = " \t\r\n"

# The request's tools: each function's name and the JSON schema of its parameters ({} if none).
ToolSchemas = dict[str, dict[str, Any]]


@dataclass(slots=True)
class ToolCallDelta:
    """A piece of one tool call. The call's first piece carries its name; the arguments are JSON
    text in fragments that join to the whole arguments object."""

    index: int  # 0, 1, 2... in order of appearance within the choice
    name: str | None = None
    arguments: str = ""


@dataclass(slots=True)
class Parsed:
    """What one piece of text turned out to be."""

    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)
    reasoning: str = ""

    def add(self, other: Parsed) -> Parsed:
        self.content += other.content
        self.tool_calls = merge_calls(self.tool_calls + other.tool_calls)
        self.reasoning += other.reasoning
        return self


@dataclass(slots=True)
class KeyedArguments:
    """A call's arguments given out a parameter at a time, for formats that write each value apart
    (XML, pythonic, Gemma 4): the JSON object of the values read, `{"KEY": value` first,
    `, "KEY": value` after, and `}` (`{}` for none) at the end."""

    index: int  # the call's
    written: int = 0

    def add(self, key: str, value: Any) -> ToolCallDelta:
        separator = ", " if self.written else "{"
        self.written += 1
        text = json.dumps(value, ensure_ascii=False, default=list)  # a Python set (pythonic) as an array
        return ToolCallDelta(self.index, None, f"{separator}{json.dumps(key, ensure_ascii=False)}: {text}")

    def close(self) -> ToolCallDelta:
        return ToolCallDelta(self.index, None, "}" if self.written else "{}")


class CallReader(Protocol):
    """JSON calls read a character at a time (json_calls.CallObject, CallArray)."""

    def feed(self, text: str) -> int: ...

    def take(self) -> list[ToolCallDelta]: ...


class ToolParser(Protocol):
    """Answer text in, content and tool-call pieces out."""

    def feed(self, text: str) -> Parsed: ...

    def finish(self) -> Parsed:
        """The stream ended: release whatever was held back."""
        ...


def merge_calls(calls: list[ToolCallDelta]) -> list[ToolCallDelta]:
    """Adjacent pieces of the same call as one (a call's name stays on its first piece); pieces
    that add nothing are dropped."""
    merged: list[ToolCallDelta] = []
    for call in calls:
        if merged and merged[-1].index == call.index and call.name is None:
            merged[-1].arguments += call.arguments
        elif call.name is not None or call.arguments:
            merged.append(ToolCallDelta(call.index, call.name, call.arguments))
    return merged


def held_prefix_len(text: str, tag: str) -> int:
    """Length of the longest end of `text` that `tag` starts with (and is shorter than the tag):
    what must be held back because the tag may be arriving."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-k:]):
            return k
    return 0


def past_closing(buffer: str, tag: str) -> str | None:
    """`buffer` after the whitespace and closing `tag` a call ends with (a missing tag is
    forgiven: what follows is text again); None while the tag may still be arriving."""
    rest = buffer.lstrip(WHITESPACE)
    if tag.startswith(rest) and len(rest) < len(tag):
        return None
    return rest.removeprefix(tag)


def run_steps(step: Callable[[Parsed], bool]) -> Parsed:
    """Run a parser's state machine over what it holds: `step` handles one state and says whether
    the state changed (so another step may apply)."""
    out = Parsed()
    while step(out):
        pass
    out.tool_calls = merge_calls(out.tool_calls)
    return out


class TextOutsideCalls:
    """Answer text around tool calls that a tag starts (any of `tags`; `found` says which did):
    content, except whitespace right before a call (dropped) and whitespace after the last call
    when the answer ends there (dropped)."""

    __slots__ = ("tags", "found", "dropped", "after_call")

    def __init__(self, *tags: str) -> None:
        self.tags = tags
        self.found = ""
        self.dropped = ""  # the whitespace dropped before the tag found
        self.after_call = False  # nothing but whitespace since the last call

    def read(self, buffer: str, out: Parsed) -> tuple[str, bool]:
        """Give out the content of `buffer` that is certain; returns (what is kept, whether a
        tag was found). Found: what is kept is the text after the tag. Not found: trailing
        whitespace and a possible start of a tag are kept."""
        hits = [(at, tag) for tag in self.tags if (at := buffer.find(tag)) >= 0]
        if hits:
            at, self.found = min(hits)
            before = buffer[:at].rstrip(WHITESPACE)
            self.dropped = buffer[len(before):at]
            self.emit(out, before)
            return buffer[at + len(self.found):], True
        upto = len(buffer) - max(held_prefix_len(buffer, tag) for tag in self.tags)
        while upto and buffer[upto - 1] in WHITESPACE:
            upto -= 1
        self.emit(out, buffer[:upto])
        return buffer[upto:], False

    def end(self, buffer: str, out: Parsed) -> None:
        """The answer ended with `buffer` held."""
        if not (self.after_call and not buffer.strip(WHITESPACE)):
            self.emit(out, buffer)

    def emit(self, out: Parsed, content: str) -> None:
        if content:
            out.content += content
            self.after_call = False

    def no_call(self, out: Parsed, text: str) -> None:
        """The tag found started no call: it, and `text` read after it, are content after all,
        with the whitespace dropped before it."""
        self.emit(out, self.dropped + self.found + text)


class BufferedParser:
    """A parser as a state machine over the text it has read and not given out (`_buffer`): in
    state S, `_in_S(out)` handles what the buffer allows and says whether the state changed (so
    another step may apply); `_end` gives out what is held when the answer ends.
    Formats whose calls a tag starts read the text around them with `_text` (`_read_text`) and
    pass each call's closing tag with `_read_closing`."""

    _buffer = ""
    _state = "text"
    _text: TextOutsideCalls

    def feed(self, text: str) -> Parsed:
        self._buffer += text
        return run_steps(self._step)

    def finish(self) -> Parsed:
        """The stream ended: release whatever was held back."""
        out = Parsed()
        self._end(out)
        self._buffer = ""
        out.tool_calls = merge_calls(out.tool_calls)
        return out

    def _step(self, out: Parsed) -> bool:
        """The current state's reader, `_in_<state>`, over the buffer."""
        return getattr(self, f"_in_{self._state}")(out)

    def _read_text(self, out: Parsed, then: str) -> bool:
        """Content up to a tag, which moves the parser to state `then`."""
        self._buffer, found = self._text.read(self._buffer, out)
        if found:
            self._state = then
        return found

    def _read_calls(self, calls: CallReader, out: Parsed) -> None:
        """What the buffer holds to `calls`, and the call pieces they make to `out`."""
        self._buffer = self._buffer[calls.feed(self._buffer):]
        out.tool_calls += calls.take()

    def _read_closing(self, tag: str) -> bool:
        """Past a call's closing `tag` (forgiven where missing) to text again."""
        rest = past_closing(self._buffer, tag)
        if rest is None:
            self._buffer = self._buffer.lstrip(WHITESPACE)
            return False
        self._buffer, self._state = rest, "text"
        return True
