"""The OpenAI Responses request (POST /v1/responses), and its translation into the chat request
that the chat path serves.

Field names and ranges are OpenAI's; `null` means absent and unknown keys are ignored, as for
chat. Items and tools the server cannot serve parse so that the translation can name them in a 400.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, ValidationError

from tailrace.serving.errors import from_validation_errors, unsupported_parameter
from tailrace.serving.protocol import (
    MAX_CHAT_TOP_LOGPROBS, ChatCompletionRequest, FunctionName, Temperature, _OpenAIModel,
)

LOGPROBS_INCLUDE = "message.output_text.logprobs"


class ContentPart(_OpenAIModel):
    type: Literal["input_text", "output_text", "refusal", "reasoning_text", "summary_text", "input_image",
                  "input_file", "input_audio"]
    text: str | None = None
    refusal: str | None = None


class Item(_OpenAIModel):
    """An input item: a message (the default type), a function call the model made, its output,
    or earlier reasoning (given to the chat template as that turn's reasoning: most drop it,
    gpt-oss's renders it before a call)."""

    type: Literal["message", "function_call", "function_call_output", "reasoning", "item_reference"] = "message"
    id: str | None = None
    role: Literal["user", "assistant", "system", "developer"] | None = None
    content: str | list[ContentPart] | None = None
    call_id: str | None = None  # function_call, function_call_output
    name: str | None = None  # function_call
    arguments: str | None = None
    output: str | list[ContentPart] | None = None  # function_call_output


class FunctionTool(_OpenAIModel):
    """`{"type": "function", "name", "parameters"}`; the built-in tools parse to be refused by name."""

    type: str
    name: FunctionName | None = None
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamedFunction(_OpenAIModel):
    type: str
    name: str | None = None


class TextFormat(_OpenAIModel):
    type: Literal["text", "json_schema", "json_object"]
    name: FunctionName = "response"
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class TextConfig(_OpenAIModel):
    format: TextFormat | None = None
    verbosity: str | None = None  # accepted and ignored


class ResponsesRequest(_OpenAIModel):
    model: str | None = None
    input: str | list[Item] = Field(default_factory=list)
    instructions: str | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: Temperature | None = None
    top_p: float | None = Field(default=None, ge=0.0, le=1.0)
    seed: int | None = Field(default=None, ge=-(2**63), le=2**63 - 1)  # extra body, as vLLM takes it
    stop: str | list[str] | None = None  # extra body
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_CHAT_TOP_LOGPROBS)
    include: list[str] | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunction | None = None
    parallel_tool_calls: bool = True
    text: TextConfig | None = None
    store: bool = True
    previous_response_id: str | None = None
    background: bool = False
    stream: bool = False
    metadata: dict[str, str] | None = None
    reasoning: dict[str, Any] | None = None  # its "effort" is Chat Completions' reasoning_effort
    # Known fields that change nothing here: accepted and ignored.
    user: str | None = None
    truncation: str | None = None
    service_tier: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None

    @property
    def with_logprobs(self) -> bool:
        return LOGPROBS_INCLUDE in (self.include or [])

    def input_items(self) -> list[Item]:
        if isinstance(self.input, str):
            return [Item(role="user", content=self.input)]
        return list(self.input)

    def chat_request(self, items: list[Item]) -> ChatCompletionRequest:
        """The instructions and the conversation `items` (earlier turns first) as a chat request;
        OpenAIError (400) for what cannot be served."""
        messages = [{"role": "system", "content": self.instructions}] if self.instructions else []
        body: dict[str, Any] = {"model": self.model or "", "messages": messages + chat_messages(items),
                                "parallel_tool_calls": self.parallel_tool_calls}
        sampling = {"max_completion_tokens": self.max_output_tokens, "temperature": self.temperature,
                    "top_p": self.top_p, "seed": self.seed, "stop": self.stop}
        body.update({name: value for name, value in sampling.items() if value is not None})
        if (self.reasoning or {}).get("effort") is not None:
            body["reasoning_effort"] = self.reasoning["effort"]
        if self.with_logprobs:
            body.update(logprobs=True, top_logprobs=self.top_logprobs or 0)
        if self.tools:
            body["tools"] = [_chat_tool(i, tool) for i, tool in enumerate(self.tools)]
        if self.tool_choice is not None:
            body["tool_choice"] = _chat_tool_choice(self.tool_choice)
        response_format = self.text.format if self.text is not None else None
        if response_format is not None and response_format.type != "text":
            body["response_format"] = {"type": response_format.type}
            if response_format.type == "json_schema":
                body["response_format"]["json_schema"] = {"name": response_format.name,
                                                          "schema": response_format.schema_ or {}}
        try:
            return ChatCompletionRequest.model_validate(body)
        except ValidationError as err:
            raise from_validation_errors(err.errors(include_url=False)) from None


def _chat_tool(index: int, tool: FunctionTool) -> dict[str, Any]:
    if tool.type != "function" or tool.name is None:
        raise unsupported_parameter(f"tools[{index}].{tool.type}")
    return {"type": "function", "function": tool.model_dump(include={"name", "description", "parameters", "strict"},
                                                            exclude_none=True)}


def _chat_tool_choice(choice: str | NamedFunction) -> str | dict[str, Any]:
    if isinstance(choice, str):
        return choice
    if choice.type != "function" or choice.name is None:
        raise unsupported_parameter(f"tool_choice.{choice.type}")
    return {"type": "function", "function": {"name": choice.name}}


def chat_messages(items: list[Item]) -> list[dict[str, Any]]:
    """Items as chat messages: reasoning is the `reasoning_content` of the assistant turn it
    starts, and a function call or an assistant message joins the turn its reasoning started; a
    function call joins the assistant message before it (or starts one), its output is a `tool`
    message."""
    messages: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        if item.type == "message" and item.role == "assistant" and _reasoning_only(messages):
            messages[-1]["content"] = _text(item.content, f"input[{i}].content")
        elif item.type == "message":
            messages.append({"role": item.role or "user", "content": _text(item.content, f"input[{i}].content")})
        elif item.type == "reasoning":
            messages.append({"role": "assistant", "content": "",
                             "reasoning_content": _text(item.content, f"input[{i}].content")})
        elif item.type == "function_call":
            if not (messages and messages[-1]["role"] == "assistant"):
                messages.append({"role": "assistant", "content": ""})
            messages[-1].setdefault("tool_calls", []).append(
                {"id": item.call_id, "type": "function",
                 "function": {"name": item.name, "arguments": item.arguments or ""}})
        elif item.type == "function_call_output":
            messages.append({"role": "tool", "tool_call_id": item.call_id,
                             "content": _text(item.output, f"input[{i}].output")})
        elif item.type == "item_reference":
            raise unsupported_parameter(f"input[{i}].item_reference")
    return messages


def _reasoning_only(messages: list[dict[str, Any]]) -> bool:
    """Whether the last message is an assistant turn with its reasoning and nothing else yet."""
    last = messages[-1] if messages else {}
    return last.get("role") == "assistant" and "reasoning_content" in last and not (last["content"] or
                                                                                    last.get("tool_calls"))


def _text(content: str | list[ContentPart] | None, where: str) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    for j, part in enumerate(content):
        if part.type in ("input_image", "input_file", "input_audio"):
            raise unsupported_parameter(f"{where}[{j}].{part.type}")
    return "".join(part.text or part.refusal or "" for part in content)
