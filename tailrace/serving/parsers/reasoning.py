"""Thinking between an opening and a closing tag: `<think>...</think>` (Qwen3, DeepSeek-R1) or
Gemma 4's thought channel, `<|channel>thought\n...<channel|>`. The thinking is reasoning, the rest
is the answer. Split-safe: a tag arriving in pieces is held until it is whole or ruled out.
"""

from __future__ import annotations

from dataclasses import dataclass

from tailrace.serving.parsers import WHITESPACE, held_prefix_len

THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"


@dataclass(frozen=True, slots=True)
class ThinkTags:
    open: str
    close: str
    special: bool = False  # special tokens, which the detokenizer must keep in the text


THINK = ThinkTags(THINK_OPEN, THINK_CLOSE)
# Each reasoning format's tags (`--reasoning-parser`).
REASONING_TAGS = {"think": THINK, "gemma4": ThinkTags("<|channel>thought\n", "<channel|>", special=True)}


def thinking_at_start(prompt: str, tags: ThinkTags = THINK) -> bool | None:
    """True where the prompt leaves the model inside a think block (templates that open it for
    the model, as DeepSeek-R1's does: the last tag in the prompt is an opening one); None where
    it ends with a closed one (thinking turned off, as Qwen3's enable_thinking=false writes an
    empty block), so the answer has no thinking; else False: the answer's start decides."""
    if prompt.rstrip().endswith(tags.close.strip()):
        return None
    return prompt.rfind(tags.open) > prompt.rfind(tags.close)


class ThinkParser:
    """One choice's text in, (reasoning, answer) pieces out.

    Without a think block open at the start, the answer's first characters decide: the opening
    tag opens one, anything else means the model answers without thinking. Whitespace between the
    closing tag and the answer is dropped.
    """

    def __init__(self, open_at_start: bool, tags: ThinkTags = THINK) -> None:
        self._state = "thinking" if open_at_start else "start"  # start | thinking | after | answer
        self._buffer = ""
        self._open, self._close = tags.open, tags.close

    def feed(self, text: str) -> tuple[str, str]:
        self._buffer += text
        reasoning = ""
        if self._state == "start":
            if self._buffer.startswith(self._open):
                self._buffer, self._state = self._buffer[len(self._open):], "thinking"
            elif self._open.startswith(self._buffer):
                return "", ""  # the tag may be arriving
            else:
                self._state = "answer"
        if self._state == "thinking":
            at = self._buffer.find(self._close)
            if at < 0:
                keep = held_prefix_len(self._buffer, self._close)
                reasoning = self._buffer[:len(self._buffer) - keep]
                self._buffer = self._buffer[len(reasoning):]
                return reasoning, ""
            reasoning, self._buffer, self._state = self._buffer[:at], self._buffer[at + len(self._close):], "after"
        if self._state == "after":
            self._buffer = self._buffer.lstrip(WHITESPACE)
            if not self._buffer:
                return reasoning, ""
            self._state = "answer"
        answer, self._buffer = self._buffer, ""
        return reasoning, answer

    def finish(self) -> tuple[str, str]:
        """The text ended: a held part of a tag is text after all."""
        held, self._buffer = self._buffer, ""
        return (held, "") if self._state == "thinking" else ("", held)
