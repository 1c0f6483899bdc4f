"""Server-sent events from lines: the client half of an OpenAI stream, kept to what the spec asks.

An event is its `data:` lines joined by newlines, dispatched at a blank line; `:` comments and the
other fields (`event:`, `id:`, `retry:`) carry nothing a benchmark needs. Servers differ in the
space after `data:` and in whether they end with a blank line, so both are tolerated.
"""

from __future__ import annotations


class SSEDecoder:
    """Feed it one line at a time (without the line ending); it hands back each event's data."""

    __slots__ = ("_data",)

    def __init__(self) -> None:
        self._data: list[str] = []

    def feed(self, line: str) -> str | None:
        if not line:
            return self.flush()
        if line.startswith(":"):
            return None
        name, _, value = line.partition(":")
        if name == "data":
            self._data.append(value[1:] if value.startswith(" ") else value)
        return None

    def flush(self) -> str | None:
        """The pending event, if any: also called at the end of the stream."""
        if not self._data:
            return None
        data = "\n".join(self._data)
        self._data.clear()
        return data


def decode_lines(lines: list[str]) -> list[str]:
    """Every event's data in a whole recorded stream."""
    decoder = SSEDecoder()
    events = [data for line in lines if (data := decoder.feed(line)) is not None]
    last = decoder.flush()
    return events if last is None else [*events, last]
