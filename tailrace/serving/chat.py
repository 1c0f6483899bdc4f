"""POST /v1/chat/completions: messages through the chat template, `chat.completion` objects or
`chat.completion.chunk`s out."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from tailrace.engine.client import EngineClient
from tailrace.serving.choices import (
    Generation, Prompt, Step, check_context, check_request, check_token_ids, envelope, respond,
)
from tailrace.serving.context import RequestContext
from tailrace.serving.errors import invalid_request
from tailrace.serving.logprobs import chat_logprob_content
from tailrace.serving.protocol import ChatCompletionRequest, ChatMessage
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
    generation = Generation(engine, head["id"], [render_prompt(engine, request)], ctx.metrics)
    pieces = ChatPieces(engine.tokenizer, request.logprobs, request.top_logprobs or 0,
                        request.return_tokens_as_token_ids)
    return await respond(generation, pieces, request, head, OBJECT)


def render_prompt(engine: EngineClient, request: ChatCompletionRequest) -> Prompt:
    """The chat template's text, tokenized. `echo` continues the last message and echoes its content."""
    continue_final = request.continue_final_message or request.echo
    try:
        text = engine.tokenizer.apply_chat_template(
            [_template_message(m) for m in request.messages],
            add_generation_prompt=request.add_generation_prompt and not continue_final,
            tools=[t.model_dump(exclude_none=True) for t in request.tools] if request.tools else None,
            continue_final_message=continue_final,
            **{k: v for k, v in (request.chat_template_kwargs or {}).items() if k not in _TEMPLATE_ARGS})
    except ValueError as err:
        raise invalid_request(str(err), param="messages") from err
    token_ids = engine.tokenizer.encode(text, add_special_tokens=False)
    check_token_ids(token_ids, None, "messages")
    params = request.to_sampling_params()
    check_context(len(token_ids), params.max_tokens, engine.max_model_len, chat=True)
    return Prompt(token_ids, params, request.messages[-1].text() if request.echo else None)


def _template_message(message: ChatMessage) -> dict[str, Any]:
    """The message as the template reads it: content as one string (text parts joined)."""
    fields = message.model_dump(exclude_none=True)
    fields["content"] = message.text()
    return fields


@dataclass(slots=True)
class ChatPieces:
    """A step as chunk choices: the role piece first for each choice (carrying the echo, if any),
    then content pieces, then a separate `delta: {}` piece with the finish_reason."""

    tokenizer: Tokenizer
    with_logprobs: bool
    top_n: int
    as_token_ids: bool

    def __call__(self, step: Step) -> list[dict[str, Any]]:
        delta, index = step.delta, step.choice.index
        pieces = []
        if step.first:
            role = {"role": "assistant", "content": step.choice.prompt.echo or ""}
            pieces.append(_piece(index, role, self._logprobs([], None), None))
        if delta.text or (self.with_logprobs and delta.token_ids):
            logprobs = self._logprobs(delta.token_ids, delta.logprobs)
            pieces.append(_piece(index, {"content": delta.text}, logprobs, None))
        if delta.finish_reason is not None:
            pieces.append(_piece(index, {}, None, delta.finish_reason))
        return pieces

    def _logprobs(self, token_ids: list[int], entries: list | None) -> dict[str, Any] | None:
        if not self.with_logprobs:
            return None
        content = chat_logprob_content(self.tokenizer, token_ids, entries, self.top_n, self.as_token_ids)
        return {"content": content, "refusal": None}

    def join(self, index: int, pieces: list[dict[str, Any]]) -> dict[str, Any]:
        """A non-stream choice: the pieces' content and logprobs joined once."""
        content = "".join(p["delta"].get("content", "") for p in pieces)
        logprobs = None
        if self.with_logprobs:
            logprobs = {"content": [t for p in pieces if p["logprobs"] for t in p["logprobs"]["content"]],
                        "refusal": None}
        finish_reason = pieces[-1]["finish_reason"] if pieces else None
        return {"index": index,
                "message": {"role": "assistant", "content": content, "refusal": None, "annotations": []},
                "logprobs": logprobs, "finish_reason": finish_reason}


def _piece(index: int, delta: dict[str, Any], logprobs: dict | None, finish_reason: str | None) -> dict[str, Any]:
    return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
