"""OpenAI's harmony format (gpt-oss): the answer is a run of messages, each a header and a body,

    <|channel|>analysis<|message|>Thinking...<|end|>
    <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{...}<|call|>
    <|start|>assistant<|channel|>final<|message|>It is sunny.<|return|>

(the generation prompt ends with `<|start|>assistant`, so the first header starts at its channel).
The analysis channel is reasoning, the final channel content, and a commentary message to
`functions.NAME` (in its header, before or after the channel) a call of NAME whose body is the
arguments; a commentary message to no one is a preamble the model writes for the user: content.
A call goes out as a call only where the request has tools; otherwise its body is content.

A call's name goes out once its header is complete, and its arguments as they are written. Text
that does not start a header where one should start (a model writing plain text) is content.
The markers are special tokens: the serving layer keeps special tokens in the text for this parser.
"""

from __future__ import annotations

from tailrace.serving.parsers import BufferedParser, Parsed, ToolCallDelta, ToolSchemas, held_prefix_len

MESSAGE = "<|message|>"
BODY_ENDS = ("<|end|>", "<|call|>", "<|return|>")
START = "<|start|>"
CHANNEL = "<|channel|>"
RECIPIENT = "to=functions."
# What a header may start with: its channel, the role (after <|start|>), or the recipient.
HEADER_STARTS = (START, CHANNEL, "assistant", " to=", "to=")


class HarmonyParser(BufferedParser):
    def __init__(self, tools: ToolSchemas | None) -> None:
        self._tools = tools
        self._state = "header"  # header | body | text
        self._channel = ""
        self._call = False  # the current body is a call's arguments
        self._written = False  # of the call's arguments, any
        self._index = 0

    def _end(self, out: Parsed) -> None:
        if self._state == "body":
            self._emit(self._buffer, out)
        elif self._state == "text":
            out.content += self._buffer
        # else a header cut off: markup, not content
        if self._call:
            self._end_call(out)

    def _in_text(self, out: Parsed) -> bool:
        out.content += self._buffer
        self._buffer = ""
        return False

    def _in_header(self, out: Parsed) -> bool:
        rest = self._buffer.lstrip("\n")
        if not rest:
            return False
        if not any(rest.startswith(s) or s.startswith(rest) for s in HEADER_STARTS):
            self._state = "text"  # no harmony here: plain text
            return True
        at = rest.find(MESSAGE)
        if at < 0:
            return False
        header, self._buffer = rest[:at], rest[at + len(MESSAGE):]
        self._channel = header.split(CHANNEL, 1)[1].split()[0] if CHANNEL in header else ""
        name = header.split(RECIPIENT, 1)[1].split()[0].split(CHANNEL)[0] if RECIPIENT in header else None
        self._call = name is not None and self._tools is not None and self._channel != "analysis"
        if self._call:
            out.tool_calls.append(ToolCallDelta(self._index, name))
            self._written = False
        self._state = "body"
        return True

    def _in_body(self, out: Parsed) -> bool:
        ends = [(self._buffer.find(end), end) for end in BODY_ENDS if end in self._buffer]
        if not ends:
            keep = max(held_prefix_len(self._buffer, end) for end in BODY_ENDS)
            self._emit(self._buffer[:len(self._buffer) - keep], out)
            self._buffer = self._buffer[len(self._buffer) - keep:]
            return False
        at, end = min(ends)
        self._emit(self._buffer[:at], out)
        self._buffer = self._buffer[at + len(end):]
        if self._call:
            self._end_call(out)
        self._buffer = self._buffer.removeprefix(START)
        self._state = "header"
        return True

    def _emit(self, text: str, out: Parsed) -> None:
        if not text:
            return
        if self._call:
            out.tool_calls.append(ToolCallDelta(self._index, None, text))
            self._written = True
        elif self._channel == "analysis":
            out.reasoning += text
        else:
            out.content += text

    def _end_call(self, out: Parsed) -> None:
        if not self._written:  # a call without arguments takes none: still a JSON object
            out.tool_calls.append(ToolCallDelta(self._index, None, "{}"))
        self._index += 1
        self._call = False
