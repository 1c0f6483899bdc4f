"""The Anthropic Messages request (POST /v1/messages and /v1/messages/count_tokens), and its
translation into the chat request that the chat path serves.

Field names and ranges are Anthropic's; unknown keys are ignored. Blocks the server cannot serve
(images, documents) parse so that the translation can name them in a 400.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from tailrace.serving.errors import from_validation_errors, unsupported_parameter
from tailrace.serving.protocol import ChatCompletionRequest, FunctionName


class _AnthropicModel(BaseModel):
    model_config = ConfigDict(extra="ignore")


class ContentBlock(_AnthropicModel):
    type: Literal["text", "tool_use", "tool_result", "thinking", "redacted_thinking", "image", "document"]
    text: str | None = None  # text
    id: str | None = None  # tool_use
    name: str | None = None
    input: dict[str, Any] | None = None
    tool_use_id: str | None = None  # tool_result
    content: str | list[ContentBlock] | None = None
    is_error: bool = False
    thinking: str | None = None  # thinking

    @model_validator(mode="after")
    def _fields_of_type(self) -> ContentBlock:
        required = {"text": ("text",), "tool_use": ("id", "name"), "tool_result": ("tool_use_id",),
                    "thinking": ("thinking",)}.get(self.type, ())
        missing = next((name for name in required if getattr(self, name) is None), None)
        if missing is not None:
            raise ValueError(f"a {self.type} block needs '{missing}'")
        return self

    def joined_text(self) -> str:
        """A tool result's content as one string."""
        if isinstance(self.content, list):
            return "".join(block.text or "" for block in self.content)
        return self.content or ""


class Message(_AnthropicModel):
    role: Literal["user", "assistant"]
    content: str | list[ContentBlock]


class ToolDefinition(_AnthropicModel):
    name: FunctionName
    description: str | None = None
    input_schema: dict[str, Any]


class ToolChoice(_AnthropicModel):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool = False

    @model_validator(mode="after")
    def _name_for_tool(self) -> ToolChoice:
        if self.type == "tool" and self.name is None:
            raise ValueError("tool_choice of type 'tool' needs 'name'")
        return self


class Thinking(_AnthropicModel):
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = None  # accepted; the think parser has no budget


class OutputFormat(_AnthropicModel):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(_AnthropicModel):
    format: OutputFormat | None = None  # structured output: the answer follows the schema
    effort: str | None = None  # accepted and ignored


class CountTokensRequest(_AnthropicModel):
    """POST /v1/messages/count_tokens: a Messages request without the sampling settings."""

    model: str
    messages: Annotated[list[Message], Field(min_length=1)]
    system: str | list[ContentBlock] | None = None
    tools: list[ToolDefinition] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None
    output_config: OutputConfig | None = None

    def chat_request(self) -> ChatCompletionRequest:
        """The same conversation as a chat request; OpenAIError (400) for what cannot be served."""
        body: dict[str, Any] = {"model": self.model, "messages": _chat_messages(self.system, self.messages)}
        if self.tools:
            body["tools"] = [{"type": "function", "function": {"name": tool.name, "description": tool.description,
                                                               "parameters": tool.input_schema}}
                             for tool in self.tools]
        if self.tool_choice is not None:
            body.update(_chat_tool_choice(self.tool_choice))
        if self.thinking is not None and self.thinking.type == "disabled":
            body["reasoning_effort"] = "none"  # chat.template_variables turns enable_thinking off too
        elif self.thinking is not None:
            body["chat_template_kwargs"] = {"enable_thinking": True}  # Qwen3-style templates read this switch
        if self.output_config is not None and self.output_config.format is not None:
            body["response_format"] = {"type": "json_schema",
                                       "json_schema": {"name": "output", "schema": self.output_config.format.schema_}}
        body.update(self._sampling())
        try:
            return ChatCompletionRequest.model_validate(body)
        except ValidationError as err:
            raise from_validation_errors(err.errors(include_url=False)) from None

    def _sampling(self) -> dict[str, Any]:
        return {}


class MessagesRequest(CountTokensRequest):
    """POST /v1/messages. `max_tokens` is required, as Anthropic requires it."""

    max_tokens: int = Field(ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=1.0)
    top_p: float | None = Field(default=None, ge=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=0)
    stop_sequences: list[str] | None = None
    stream: bool = False
    metadata: dict[str, Any] | None = None  # accepted and ignored

    def _sampling(self) -> dict[str, Any]:
        """Only what the client set, so the model's sampling defaults fill the rest."""
        body: dict[str, Any] = {"max_tokens": self.max_tokens}
        body.update({name: getattr(self, name) for name in ("temperature", "top_p", "top_k")
                     if getattr(self, name) is not None})
        if self.stop_sequences:
            body["stop"] = self.stop_sequences
        return body


def _chat_tool_choice(choice: ToolChoice) -> dict[str, Any]:
    body: dict[str, Any] = {"parallel_tool_calls": not choice.disable_parallel_tool_use}
    if choice.type == "tool":
        body["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
    else:
        body["tool_choice"] = {"any": "required"}.get(choice.type, choice.type)
    return body


def _chat_messages(system: str | list[ContentBlock] | None, messages: list[Message]) -> list[dict[str, Any]]:
    """Anthropic's turns as chat messages: the system prompt first; a user turn's tool results as
    `tool` messages ahead of its text; an assistant turn's tool_use blocks as its tool calls."""
    chat: list[dict[str, Any]] = []
    if system:
        chat.append({"role": "system", "content": system if isinstance(system, str) else _text(system)})
    for i, message in enumerate(messages):
        if isinstance(message.content, str):
            chat.append({"role": message.role, "content": message.content})
            continue
        for j, block in enumerate(message.content):
            if block.type in ("image", "document", "redacted_thinking"):
                raise unsupported_parameter(f"messages[{i}].content[{j}].{block.type}")
        if message.role == "user":
            chat += [{"role": "tool", "tool_call_id": block.tool_use_id, "content": block.joined_text()}
                     for block in message.content if block.type == "tool_result"]
            text = _text(message.content)
            if text or not any(block.type == "tool_result" for block in message.content):
                chat.append({"role": "user", "content": text})
            continue
        chat.append(_assistant_message(message.content))
    return chat


def _assistant_message(blocks: list[ContentBlock]) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": _text(blocks)}
    calls = [{"id": block.id, "type": "function",
              "function": {"name": block.name, "arguments": json.dumps(block.input or {})}}
             for block in blocks if block.type == "tool_use"]
    if calls:
        message["tool_calls"] = calls
    thinking = "".join(block.thinking or "" for block in blocks if block.type == "thinking")
    if thinking:
        message["reasoning_content"] = thinking
    return message


def _text(blocks: list[ContentBlock]) -> str:
    return "".join(block.text or "" for block in blocks if block.type == "text")
