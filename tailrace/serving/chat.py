"""POST /v1/chat/completions: messages through the chat template, `chat.completion` objects or
`chat.completion.chunk`s out."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from tailrace.engine.client import EngineClient
from tailrace.serving.answers import plan_answer
from tailrace.serving.choices import (
    Generation, Prompt, Step, check_context, check_request, check_token_ids, envelope, respond,
)
from tailrace.serving.context import RequestContext
from tailrace.serving.errors import invalid_request
from tailrace.serving.logprobs import chat_logprob_content
from tailrace.serving.parsers import Parsed, ToolCallDelta
from tailrace.serving.parsers.choice import AnswerFormat, ChoiceParser
from tailrace.serving.protocol import ChatCompletionRequest
from tailrace.serving.template_fit import fit_call_ids
from tailrace.tokenizer import Tokenizer

OBJECT = "chat.completion"
CHUNK_OBJECT = "chat.completion.chunk"
# Arguments render_prompt sets itself; chat_template_kwargs may not override them.
_TEMPLATE_ARGS = frozenset({"messages", "add_generation_prompt", "tools", "continue_final_message"})


async def create_chat_completion(engine: EngineClient, request: ChatCompletionRequest,
                                 ctx: RequestContext) -> dict[str, Any] | AsyncIterator[dict[str, Any]]:
    """Validate and render now (errors raise OpenAIError before any byte is sent); then either
    the whole response or an iterator of chunks."""
    check_request(engine, request)
    head = envelope("chatcmpl", CHUNK_OBJECT, ctx)
    prompt, answers = render_prompt(engine, request, ctx)
    generation = Generation(engine, head["id"], [prompt], ctx)
    pieces = ChatPieces(engine.tokenizer, request.logprobs, request.top_logprobs or 0,
                        request.return_tokens_as_token_ids, answers)
    return await respond(generation, pieces, request, head, OBJECT)


def render_prompt(engine: EngineClient, request: ChatCompletionRequest,
                  ctx: RequestContext) -> tuple[Prompt, AnswerFormat]:
    """The chat template's text, tokenized, and how the answer is to be read. `echo` continues
    the last message and echoes its content."""
    continue_final = request.continue_final_message or request.echo
    try:
        text = engine.tokenizer.apply_chat_template(
            fit_call_ids([m.template_dict() for m in request.messages], ctx.chat.call_id_length),
            add_generation_prompt=request.add_generation_prompt and not continue_final,
            tools=[t.model_dump(exclude_none=True) for t in request.tools] if request.tools else None,
            continue_final_message=continue_final, **template_variables(request))
    except ValueError as err:
        raise invalid_request(str(err), param="messages") from err
    token_ids = engine.tokenizer.encode(text, add_special_tokens=False)
    check_token_ids(token_ids, None, "messages")
    params = request.to_sampling_params()
    plan = plan_answer(request, engine.tokenizer, ctx.chat, text)
    plan.apply(params)
    named = "max_completion_tokens" if request.max_completion_tokens is not None else "max_tokens"
    check_context(len(token_ids), params.max_tokens, engine.max_model_len, chat=True, max_tokens_param=named)
    return Prompt(token_ids, params, request.messages[-1].text() if request.echo else None), plan.format


def template_variables(request: ChatCompletionRequest) -> dict[str, Any]:
    """What the request sets for the template besides the conversation: `reasoning_effort` as
    gpt-oss's template reads it, "none" also as `enable_thinking` off (Qwen3's and SmolLM3's
    switch), and chat_template_kwargs over both."""
    variables: dict[str, Any] = {}
    if request.reasoning_effort is not None:
        variables["reasoning_effort"] = request.reasoning_effort
        if request.reasoning_effort == "none":
            variables["enable_thinking"] = False
    variables.update(request.chat_template_kwargs or {})
    return {k: v for k, v in variables.items() if k not in _TEMPLATE_ARGS}


@dataclass(slots=True)
class ChatPieces:
    """A step as chunk choices: the role piece first for each choice (carrying the echo, if any),
    then a piece with what the step's text turned out to be (reasoning, content, tool-call
    deltas), then a separate `delta: {}` piece with the finish_reason. Each choice reads its
    text with its own parser, created with its first step and dropped with its last."""

    tokenizer: Tokenizer
    with_logprobs: bool
    top_n: int
    as_token_ids: bool
    answers: AnswerFormat = field(default_factory=AnswerFormat)
    _parsers: dict[int, ChoiceParser] = field(default_factory=dict)
    _calls: dict[int, int] = field(default_factory=dict)  # tool calls announced, per choice

    def __call__(self, step: Step) -> list[dict[str, Any]]:
        delta, index = step.delta, step.choice.index
        pieces = []
        if step.first:
            self._parsers[index] = self.answers.parser()
            self._calls[index] = 0
            role = {"role": "assistant", "content": step.choice.prompt.echo or ""}
            pieces.append(_piece(index, role, self._logprobs([], None), None))
        parser = self._parsers[index]
        parsed = parser.feed(delta.text)
        if delta.finish_reason is not None:
            parsed.add(parser.finish())
        fields = self._delta_fields(index, parsed)
        if fields or (self.with_logprobs and delta.token_ids):
            logprobs = self._logprobs(delta.token_ids, delta.logprobs)
            pieces.append(_piece(index, fields or {"content": ""}, logprobs, None))
        if delta.finish_reason is not None:
            called = self._calls.pop(index) > 0
            del self._parsers[index]
            # An answer that ended in tool calls says so; one cut short stays "length".
            reason = "tool_calls" if called and delta.finish_reason == "stop" else delta.finish_reason
            pieces.append(_piece(index, {}, None, reason, delta.stop_reason))
        return pieces

    def _delta_fields(self, index: int, parsed: Parsed) -> dict[str, Any]:
        fields: dict[str, Any] = {}
        if parsed.reasoning:
            fields[self.answers.reasoning_field] = parsed.reasoning
        if parsed.content:
            fields["content"] = parsed.content
        calls = [call for call in parsed.tool_calls if self.answers.parallel_calls or call.index == 0]
        if calls:
            fields["tool_calls"] = [self._wire_call(index, call) for call in calls]
        return fields

    def _wire_call(self, index: int, call: ToolCallDelta) -> dict[str, Any]:
        """A tool-call delta as clients concatenate it: id, type and name on a call's first delta
        only, `index` and `function` on every one."""
        if call.name is None:
            return {"index": call.index, "function": {"arguments": call.arguments}}
        self._calls[index] += 1
        return {"index": call.index, "id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                "function": {"name": call.name, "arguments": call.arguments}}

    def _logprobs(self, token_ids: list[int], entries: list | None) -> dict[str, Any] | None:
        if not self.with_logprobs:
            return None
        content = chat_logprob_content(self.tokenizer, token_ids, entries, self.top_n, self.as_token_ids)
        return {"content": content, "refusal": None}

    def join(self, index: int, pieces: list[dict[str, Any]]) -> dict[str, Any]:
        """A non-stream choice: the pieces' content, reasoning, tool calls and logprobs joined once."""
        deltas = [p["delta"] for p in pieces]
        content = "".join(d.get("content") or "" for d in deltas)
        calls: list[dict[str, Any]] = []
        for call in (c for d in deltas for c in d.get("tool_calls", [])):
            if "id" in call:
                calls.append({"id": call["id"], "type": "function", "function": dict(call["function"])})
            else:
                calls[call["index"]]["function"]["arguments"] += call["function"]["arguments"]
        message: dict[str, Any] = {"role": "assistant", "content": content if content or not calls else None,
                                   "refusal": None, "annotations": []}
        if calls:
            message["tool_calls"] = calls
        if self.answers.has_reasoning:
            field_name = self.answers.reasoning_field
            message[field_name] = "".join(d.get(field_name) or "" for d in deltas) or None
        logprobs = None
        if self.with_logprobs:
            logprobs = {"content": [t for p in pieces if p["logprobs"] for t in p["logprobs"]["content"]],
                        "refusal": None}
        final = pieces[-1] if pieces else _piece(index, {}, None, None)
        return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": final["finish_reason"],
                "stop_reason": final["stop_reason"]}


def _piece(index: int, delta: dict[str, Any], logprobs: dict | None, finish_reason: str | None,
           stop_reason: str | int | None = None) -> dict[str, Any]:
    """A chunk choice. `stop_reason` is vLLM's: the stop string or stop token id that ended the
    choice, null when it ended otherwise (or has not ended)."""
    return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason,
            "stop_reason": stop_reason}
