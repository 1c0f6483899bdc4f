"""One choice's text, read the way the request asks: thinking split off first, then tool calls
parsed out of the answer (so stop strings and tool calls only ever see the answer)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from tailrace.serving.parsers import Parsed, ToolParser
from tailrace.serving.parsers.hermes import HermesToolParser
from tailrace.serving.parsers.llama3 import Llama3JsonToolParser
from tailrace.serving.parsers.mistral import MistralToolParser
from tailrace.serving.parsers.reasoning import ThinkParser

TOOL_PARSERS: dict[str, Callable[[], ToolParser]] = {
    "hermes": HermesToolParser,
    "llama3": Llama3JsonToolParser,
    "llama3_json": Llama3JsonToolParser,  # vLLM's name for the same format
    "mistral": MistralToolParser,
}
REASONING_PARSERS = ("think",)
REASONING_FIELDS = ("reasoning_content", "reasoning")


def detect_tool_parser(chat_template: str | None) -> str | None:
    """The tool-call format a chat template teaches its model, from the markers it writes; None
    when it shows none (tool calls are then not parsed)."""
    if not chat_template:
        return None
    if "<tool_call>" in chat_template:
        return "hermes"
    if "[TOOL_CALLS]" in chat_template:
        return "mistral"
    if "<|python_tag|>" in chat_template or '"parameters"' in chat_template:
        return "llama3"
    return None


@dataclass(slots=True, frozen=True)
class AnswerFormat:
    """How every choice of one request reads its text."""

    tool_parser: Callable[[], ToolParser] | None = None
    thinking: bool | None = None  # None: no thinking split; else whether a think block is open at the start
    reasoning_field: str = "reasoning_content"

    def parser(self) -> ChoiceParser:
        think = ThinkParser(self.thinking) if self.thinking is not None else None
        return ChoiceParser(think, self.tool_parser() if self.tool_parser is not None else None)


class ChoiceParser:
    def __init__(self, think: ThinkParser | None, tools: ToolParser | None) -> None:
        self._think = think
        self._tools = tools

    def feed(self, text: str) -> Parsed:
        reasoning, answer = self._think.feed(text) if self._think is not None else ("", text)
        out = self._tools.feed(answer) if self._tools is not None else Parsed(content=answer)
        out.reasoning = reasoning
        return out

    def finish(self) -> Parsed:
        reasoning, answer = self._think.finish() if self._think is not None else ("", "")
        if self._tools is None:
            return Parsed(content=answer, reasoning=reasoning)
        out = self._tools.feed(answer).add(self._tools.finish())
        out.reasoning = reasoning
        return out
