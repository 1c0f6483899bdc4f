"""How one chat request's answer is made and read, decided once before it is queued: the grammar
it must follow, where the model's thinking ends, and which tool-call parser reads it."""

from __future__ import annotations

from dataclasses import dataclass

from tailrace.sampling_params import SamplingParams, StructuredSpec, ThinkTokens
from tailrace.serving.context import ChatOptions
from tailrace.serving.parsers import ToolSchemas
from tailrace.serving.parsers.choice import (HARMONY_TOOLS, SPECIAL_TOKEN_FORMATS, AnswerFormat,
                                             detect_reasoning_parser, detect_tool_parser, harmony_format,
                                             tool_parser_for)
from tailrace.serving.parsers.reasoning import REASONING_TAGS, THINK, THINK_CLOSE, THINK_OPEN, thinking_at_start
from tailrace.serving.protocol import ChatCompletionRequest
from tailrace.serving.structured import constraint_for
from tailrace.tokenizer import Tokenizer


@dataclass(slots=True)
class AnswerPlan:
    format: AnswerFormat
    structured: StructuredSpec | None = None
    thinking: ThinkTokens | None = None
    keep_special_tokens: bool = False  # the tool-call format is marked by a special token

    def apply(self, params: SamplingParams) -> None:
        params.structured = self.structured
        params.thinking = self.thinking
        if self.keep_special_tokens:
            params.skip_special_tokens = False


def plan_answer(request: ChatCompletionRequest, tokenizer: Tokenizer, options: ChatOptions,
                prompt_text: str) -> AnswerPlan:
    """OpenAIError (400) when response_format or tool_choice cannot be served."""
    # Several calls in one answer only where the client allows them and the template can show them.
    parallel = request.parallel_tool_calls and options.parallel_calls
    constraint = constraint_for(request, parallel)
    template = tokenizer.chat_template
    tools_format = tool_parser_name(options.tool_call_parser, template)
    reasoning = reasoning_parser_name(options.reasoning_parser, template)
    may_call = bool(request.tools) and request.tool_choice in (None, "auto")
    if constraint is None and (tools_format == HARMONY_TOOLS or reasoning == "harmony"):
        return AnswerPlan(harmony_format(tool_schemas(request) if may_call else None, options.reasoning_field,
                                         parallel), keep_special_tokens=True)
    parser_name = None
    if constraint is not None:
        tool_parser = constraint.tool_parser
    elif may_call:
        parser_name = tools_format
        tool_parser = tool_parser_for(parser_name, tool_schemas(request))
    else:
        tool_parser = None  # "none" still shows the tools to the model, but nothing is parsed
    tags = REASONING_TAGS.get(reasoning or "", THINK)
    open_at_start = thinking_at_start(prompt_text, tags) if reasoning in REASONING_TAGS else None
    if open_at_start is False and request.reasoning_effort == "none":
        open_at_start = None  # the client asked for no thinking: the answer (and its grammar) starts at once
    # The engine finds where the answer starts by the tags' token ids, where each tag is one token.
    tokens = think_tokens(tokenizer, open_at_start) if reasoning == "think" and open_at_start is not None else None
    special = parser_name in SPECIAL_TOKEN_FORMATS or (open_at_start is not None and tags.special)
    return AnswerPlan(AnswerFormat(tool_parser, open_at_start, options.reasoning_field, think_tags=tags,
                                   parallel_calls=parallel),
                      constraint.spec if constraint is not None else None, tokens, special)


def tool_schemas(request: ChatCompletionRequest) -> ToolSchemas:
    """The request's functions by name, each with the schema of its parameters."""
    return {tool.function.name: tool.function.parameters or {} for tool in request.tools or []
            if tool.function is not None}


def tool_parser_name(option: str, chat_template: str | None) -> str | None:
    """The format the server's option names ("none": the model has none; "auto": its template's)."""
    if option == "auto":
        return detect_tool_parser(chat_template)[0]
    return None if option == "none" else option


def reasoning_parser_name(option: str | None, chat_template: str | None) -> str | None:
    return detect_reasoning_parser(chat_template)[0] if option == "auto" else option


def think_tokens(tokenizer: Tokenizer, open_at_start: bool) -> ThinkTokens | None:
    """The think tags as token ids, for the engine to find where the answer starts; None when a
    tag is not one token (stop strings and the grammar then cover the whole output)."""
    open_id, close_id = tokenizer.hf.token_to_id(THINK_OPEN), tokenizer.hf.token_to_id(THINK_CLOSE)
    if open_id is None or close_id is None:
        return None
    return ThinkTokens(open_id, close_id, open_at_start)
