"""The forms small models drift into when their template teaches another (llama.cpp's server
accepts the same): a call in a ```json fence, the whole answer a bare JSON call object (or an
array of them), or `<function=NAME>{...}</function>`.

Only a request with tools is read this way, and only a call to one of its tools counts, so JSON
in an ordinary answer is never taken for a call. The forms are looked for where an answer starts
and after each call read so: text there that could still become one is held until it is whole
or ruled out, and anything else goes to the model's own format's parser (`inner`) as written.
A call read here goes out whole, its arguments as `json.dumps` writes them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from tailrace.serving.parsers import WHITESPACE, BufferedParser, Parsed, ToolCallDelta, ToolParser, ToolSchemas
from tailrace.serving.parsers.json_calls import ARGUMENT_KEYS, JsonValue



class FallbackToolParser(BufferedParser):
    """`inner`: the model's own format (None: none, the answer is content). `bare_json` off where
    the inner format is itself a bare JSON object (Llama 3's), which streams it more finely."""

    def __init__(self, inner: ToolParser | None, tools: ToolSchemas, bare_json: bool = True) -> None:
        self._inner = inner
        self._tools = tools
        self._bare_json = bare_json
        self._held = ""  # the whitespace before a would-be call, given on with it if it is none
        self._state = "start"  # start | opening | value | closing | inner
        self._form: _Form | None = None
        self._value: JsonValue | None = None
        self._value_at = 0  # where the JSON value starts in the buffer
        self._read = 0  # how much of the buffer the value has read
        self._calls = 0  # read here; the inner parser's calls are numbered after them

    def _end(self, out: Parsed) -> None:
        if self._state != "inner":
            self._give_up(out)
        self._add_inner(self._inner.finish() if self._inner is not None else Parsed(), out)

    def _in_inner(self, out: Parsed) -> bool:
        text, self._buffer = self._buffer, ""
        if text:
            self._add_inner(self._inner.feed(text) if self._inner is not None else Parsed(content=text), out)
        return False

    def _in_start(self, out: Parsed) -> bool:
        rest = self._buffer.lstrip(WHITESPACE)
        if not rest:
            return False
        self._held += self._buffer[:len(self._buffer) - len(rest)]
        self._buffer = rest
        forms = [form for form in FORMS if form.opening or self._bare_json]
        if any(_opens(rest, form.opening) for form in forms if form.opening):
            return False  # a form's opening may be arriving
        self._form = next((form for form in forms if rest.startswith(form.opening)), None)
        if self._form is None or (not self._form.opening and rest[0] not in "{["):
            self._give_up(out)
            return True
        self._state = "opening"
        return True

    def _in_opening(self, out: Parsed) -> bool:
        """The form's opening through its end (```LANG's newline, `<function=NAME>`'s `>`), then
        up to the JSON value, which must be an object or an array."""
        form = self._form
        end = self._buffer.find(form.opening_end, len(form.opening)) if form.opening_end else 0
        if end < 0:
            return False
        label = self._buffer[len(form.opening):end].strip()
        if form.labels is not None and label not in form.labels:
            self._give_up(out)
            return True
        start = end + len(form.opening_end)
        value = self._buffer[start:].lstrip(WHITESPACE)
        if not value:
            return False
        if value[0] not in "{[":
            self._give_up(out)
            return True
        self._value_at = self._read = len(self._buffer) - len(value)
        self._value, self._state = JsonValue(), "value"
        return True

    def _in_value(self, out: Parsed) -> bool:
        self._read += self._value.feed(self._buffer[self._read:])
        if not self._value.done:
            return False
        self._state = "closing"
        return True

    def _in_closing(self, out: Parsed) -> bool:
        closing = self._form.closing
        rest = self._buffer[self._read:].lstrip(WHITESPACE) if closing else ""
        if closing and (not rest or _opens(rest, closing)):
            return False  # the closing may be arriving
        if closing and not rest.startswith(closing):
            self._give_up(out)
            return True
        end = len(self._buffer) - len(rest) + len(closing) if closing else self._read
        value = _loads(self._buffer[self._value_at:self._read])
        name = self._buffer[len(self._form.opening):self._buffer.find(">")].strip() if self._form.named else None
        calls = _calls_in({"name": name, "arguments": value} if self._form.named else value, self._tools)
        if calls is None:
            self._give_up(out)
            return True
        for call_name, arguments in calls:
            out.tool_calls.append(ToolCallDelta(self._calls, call_name, json.dumps(arguments, ensure_ascii=False)))
            self._calls += 1
        self._buffer, self._held, self._state = self._buffer[end:], "", "start"
        return True

    def _give_up(self, out: Parsed) -> None:
        """No call here: from here on the answer is the inner format's (or content)."""
        text = self._held + self._buffer
        self._held, self._buffer, self._state = "", "", "inner"
        if self._calls and not text.strip(WHITESPACE):
            return  # whitespace after the calls
        if text:
            self._add_inner(self._inner.feed(text) if self._inner is not None else Parsed(content=text), out)

    def _add_inner(self, parsed: Parsed, out: Parsed) -> None:
        for call in parsed.tool_calls:
            call.index += self._calls
        out.add(parsed)


@dataclass(frozen=True, slots=True)
class _Form:
    opening: str  # "" for a bare JSON value
    opening_end: str  # what ends the opening ("" when the value follows the opening at once)
    labels: tuple[str, ...] | None  # what may stand between the opening and its end (None: a name)
    closing: str
    named: bool = False  # the call's name is in the opening, the value is its arguments


FORMS = (_Form("```", "\n", ("", "json", "tool_call", "tool_code"), "```"),
         _Form("<function=", ">", None, "</function>", named=True),
         _Form("", "", ("",), ""))


def _opens(text: str, tag: str) -> bool:
    """Whether `text` is a proper start of `tag`."""
    return len(text) < len(tag) and tag.startswith(text)


def _loads(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return None


def _calls_in(value: Any, tools: ToolSchemas) -> list[tuple[str, dict[str, Any]]] | None:
    """The calls a parsed form holds: a call object or a non-empty array of them, each naming one
    of `tools` with an object of arguments (or none); None if it is anything else."""
    items = value if isinstance(value, list) and value else [value]
    calls = []
    for item in items:
        if not isinstance(item, dict) or item.get("name") not in tools:
            return None
        keys = [key for key in ARGUMENT_KEYS if key in item]
        arguments = item[keys[0]] if keys else {}
        if arguments is None:
            arguments = {}
        if not isinstance(arguments, dict) or set(item) - {"name", *ARGUMENT_KEYS}:
            return None
        calls.append((item["name"], arguments))
    return calls
