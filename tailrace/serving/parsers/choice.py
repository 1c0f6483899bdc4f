"""One choice's text, read the way the request asks: thinking split off first, then tool calls
parsed out of the answer (so stop strings and tool calls only ever see the answer)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from tailrace.serving.context import ChatOptions
from tailrace.serving.parsers import Parsed, ToolParser, ToolSchemas
from tailrace.serving.parsers.deepseek import CALLS_BEGIN, DeepSeekToolParser
from tailrace.serving.parsers.fallback import FallbackToolParser
from tailrace.serving.parsers.gemma4 import Gemma4ToolParser
from tailrace.serving.parsers.harmony import CHANNEL, HarmonyParser
from tailrace.serving.parsers.hermes import HermesToolParser
from tailrace.serving.parsers.llama3 import Llama3JsonToolParser
from tailrace.serving.parsers.mistral import MistralToolParser
from tailrace.serving.parsers.pythonic import PythonicToolParser
from tailrace.serving.parsers.qwen3_xml import Qwen3XmlToolParser
from tailrace.serving.parsers.reasoning import REASONING_TAGS, THINK, ThinkParser, ThinkTags
from tailrace.serving.parsers.tagged_json import TaggedJsonToolParser

HARMONY_TOOLS = "openai"  # vLLM's name for gpt-oss's tool calls, which harmony_format reads
# Each format's parser, made for one choice from the request's tools.
TOOL_PARSERS: dict[str, Callable[[ToolSchemas], ToolParser]] = {
    "hermes": lambda tools: HermesToolParser(),
    "llama3": lambda tools: Llama3JsonToolParser(),
    "llama3_json": lambda tools: Llama3JsonToolParser(),  # vLLM's name for the same format
    "mistral": lambda tools: MistralToolParser(),
    "qwen3_coder": Qwen3XmlToolParser,  # vLLM's name; Qwen3.5 writes the same
    "phi4_mini_json": lambda tools: TaggedJsonToolParser(),  # <|tool_call|>[...]<|/tool_call|>
    "granite": lambda tools: TaggedJsonToolParser(end=None),  # <|tool_call|>[...]
    "pythonic": lambda tools: PythonicToolParser(),  # [f(a=1), g()]
    "llama4_pythonic": lambda tools: PythonicToolParser(),  # vLLM's name for Llama 4's
    "deepseek_v3": lambda tools: DeepSeekToolParser(),  # V3, R1 and (vLLM's deepseek_v31) V3.1
    "deepseek_v31": lambda tools: DeepSeekToolParser(),
    HARMONY_TOOLS: HarmonyParser,  # gpt-oss: read with its reasoning (harmony_format)
    "gemma4": lambda tools: Gemma4ToolParser(),  # <|tool_call>call:NAME{key:value}<tool_call|>
}
# Formats marked by special tokens, which the detokenizer must keep in the text.
SPECIAL_TOKEN_FORMATS = ("mistral", "phi4_mini_json", "granite", "deepseek_v3", "deepseek_v31", HARMONY_TOOLS, "gemma4")
# Formats whose own parser reads a bare JSON call object (the fallback leaves it to them).
_BARE_JSON_FORMATS = ("llama3", "llama3_json")
# "think" and the names vLLM gives the same <think> format; "harmony" (vLLM: openai_gptoss) for
# gpt-oss, whose parser reads its tool calls too (vLLM's tool-call parser name for it: openai).
REASONING_PARSERS = {"think": "think", "deepseek_r1": "think", "qwen3": "think", "harmony": "harmony",
                     "openai_gptoss": "harmony", "gemma4": "gemma4"}
REASONING_FIELDS = ("reasoning_content", "reasoning")


# What a chat template writes for each tool-call format, checked in this order (Qwen3-Coder's
# template also writes <tool_call>), and what that shows.
_TEMPLATE_MARKERS = (
    (HARMONY_TOOLS, (CHANNEL, " to="), "it writes harmony messages, calls to=functions.NAME"),
    ("gemma4", ("<|tool_call>call:",), "it writes <|tool_call>call:NAME{...} calls"),
    ("qwen3_coder", ("<function=", "<parameter="), "it writes <function=NAME><parameter=KEY> calls"),
    ("hermes", ("<tool_call>",), "it writes <tool_call> blocks"),
    ("mistral", ("[TOOL_CALLS]",), "it writes [TOOL_CALLS]"),
    ("deepseek_v3", (CALLS_BEGIN,), f"it writes {CALLS_BEGIN}"),
    ("phi4_mini_json", ("<|tool_call|>", "<|/tool_call|>"), "it writes <|tool_call|>...<|/tool_call|>"),
    ("phi4_mini_json", ("<|tool|>", "<|/tool|>"), "it lists tools in a <|tool|> block, as Phi-4-mini's does"),
    ("granite", ("<|tool_call|>",), "it writes <|tool_call|> without a closing tag"),
    ("pythonic", ("<|python_start|>",), "it writes <|python_start|> calls, as Llama 4's does"),
    ("pythonic", ("[func_name1(",), "it asks for [func_name(param=value)] calls"),
    ("llama3", ("<|python_tag|>",), "it writes <|python_tag|>"),
    ("llama3", ('"parameters"',), "it shows tools as JSON objects with \"parameters\""),
)


def detect_tool_parser(chat_template: str | None) -> tuple[str | None, str]:
    """The tool-call format a chat template teaches its model, from the markers it writes (None
    when it shows none: then only the forms models drift into are read), and why."""
    for name, markers, why in _TEMPLATE_MARKERS:
        if chat_template and all(marker in chat_template for marker in markers):
            return name, f"the chat template shows it: {why}"
    return None, "the chat template shows no tool-call format"


def detect_reasoning_parser(chat_template: str | None) -> tuple[str | None, str]:
    """The reasoning format a chat template writes, and why: `harmony` for harmony's channels
    (gpt-oss), `gemma4` for Gemma 4's thought channel, `think` for <think> blocks (Qwen3, SmolLM3,
    DeepSeek-R1 and its distills); else None. The parsers read an answer that opens no block as
    it is."""
    if chat_template and CHANNEL in chat_template:
        return "harmony", "the chat template writes harmony channels (analysis is the reasoning)"
    if chat_template and REASONING_TAGS["gemma4"].open.strip() in chat_template:
        return "gemma4", "the chat template writes Gemma 4's thought channel"
    if chat_template and THINK.open in chat_template:
        return "think", "the chat template writes <think> blocks"
    return None, "the chat template writes no thinking block"


def resolve_formats(options: ChatOptions, chat_template: str | None) -> tuple[ChatOptions, str]:
    """The server's options with "auto" decided from its chat template, and one line that says
    what reads tool calls and thinking, and why."""
    tools, tools_why = ((options.tool_call_parser, "--tool-call-parser") if options.tool_call_parser != "auto"
                        else detect_tool_parser(chat_template))
    reasoning, reasoning_why = ((options.reasoning_parser, "--reasoning-parser") if options.reasoning_parser != "auto"
                                else detect_reasoning_parser(chat_template))
    line = (f"answer formats: tool calls = {tools or 'none'} ({tools_why}), with the drifted forms for "
            f"requests with tools | reasoning = {reasoning or 'none'} ({reasoning_why})")
    return replace(options, tool_call_parser=tools or "none", reasoning_parser=reasoning), line


def tool_parser_for(name: str | None, tools: ToolSchemas) -> Callable[[], ToolParser]:
    """What reads a choice of a request with `tools` when the model may call one (tool_choice
    "auto"): format `name`'s parser (None: the model has none), under the forms models drift into."""
    inner = TOOL_PARSERS[name] if name is not None else None
    return lambda: FallbackToolParser(inner(tools) if inner is not None else None, tools,
                                      bare_json=name not in _BARE_JSON_FORMATS)


def harmony_format(tools: ToolSchemas | None, reasoning_field: str, parallel_calls: bool) -> AnswerFormat:
    """gpt-oss's answers: every message read by the harmony parser, reasoning and (where the
    request lets the model call `tools`) tool calls with it."""
    return AnswerFormat(lambda: HarmonyParser(tools), None, reasoning_field, harmony=True,
                        parallel_calls=parallel_calls)


@dataclass(slots=True, frozen=True)
class AnswerFormat:
    """How every choice of one request reads its text."""

    tool_parser: Callable[[], ToolParser] | None = None
    thinking: bool | None = None  # None: no thinking split; else whether a think block is open at the start
    reasoning_field: str = "reasoning_content"
    harmony: bool = False  # the tool parser is harmony's, which reads the reasoning too
    think_tags: ThinkTags = THINK
    parallel_calls: bool = True  # else only a choice's first call is given out

    @property
    def has_reasoning(self) -> bool:
        return self.thinking is not None or self.harmony

    def parser(self) -> ChoiceParser:
        think = ThinkParser(self.thinking, self.think_tags) if self.thinking is not None else None
        return ChoiceParser(think, self.tool_parser() if self.tool_parser is not None else None)


class ChoiceParser:
    def __init__(self, think: ThinkParser | None, tools: ToolParser | None) -> None:
        self._think = think
        self._tools = tools

    def feed(self, text: str) -> Parsed:
        reasoning, answer = self._think.feed(text) if self._think is not None else ("", text)
        out = self._tools.feed(answer) if self._tools is not None else Parsed(content=answer)
        out.reasoning = reasoning + out.reasoning
        return out

    def finish(self) -> Parsed:
        reasoning, answer = self._think.finish() if self._think is not None else ("", "")
        if self._tools is None:
            return Parsed(content=answer, reasoning=reasoning)
        out = self._tools.feed(answer).add(self._tools.finish())
        out.reasoning = reasoning + out.reasoning
        return out
