"""POST /v1/completions: prompts in, `text_completion` objects or chunks out."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from tailrace.engine.client import EngineClient
from tailrace.serving.choices import (
    Generation, Prompt, Step, check_context, check_request, check_token_ids, envelope, respond,
)
from tailrace.serving.context import RequestContext
from tailrace.serving.logprobs import (
    completion_logprobs, empty_completion_logprobs, extend_completion_logprobs, token_offsets,
)
from tailrace.serving.protocol import CompletionRequest, prompt_list
from tailrace.tokenizer import Tokenizer

OBJECT = "text_completion"


async def create_completion(engine: EngineClient, request: CompletionRequest,
                            ctx: RequestContext) -> dict[str, Any] | AsyncIterator[dict[str, Any]]:
    """Validate and tokenize now (errors raise OpenAIError before any byte is sent); then either
    the whole response or an iterator of chunks."""
    check_request(engine, request)
    head = envelope("cmpl", OBJECT, ctx)
    generation = Generation(engine, head["id"], tokenize_prompts(engine, request), ctx)
    pieces = CompletionPieces(engine.tokenizer, request.logprobs is not None, request.return_tokens_as_token_ids)
    return await respond(generation, pieces, request, head, OBJECT)


def tokenize_prompts(engine: EngineClient, request: CompletionRequest) -> list[Prompt]:
    """One Prompt per prompt the client sent. A text prompt echoes as sent; token ids echo as
    their decoded text."""
    tokenizer = engine.tokenizer
    params = request.to_sampling_params()
    prompts = []
    for item in prompt_list(request.prompt):
        token_ids = tokenizer.encode(item) if isinstance(item, str) else list(item)
        check_token_ids(token_ids, tokenizer.vocab_size, "prompt")
        check_context(len(token_ids), params.max_tokens, engine.max_model_len, chat=False)
        echo = None
        if request.echo:
            echo = item if isinstance(item, str) else tokenizer.decode(token_ids, skip_special_tokens=False)
        prompts.append(Prompt(token_ids, params, echo))
    return prompts


@dataclass(slots=True)
class CompletionPieces:
    """A step as completion choice objects: a content piece (echo on the choice's first), then a
    separate `text: ""` piece with the finish_reason."""

    tokenizer: Tokenizer
    with_logprobs: bool
    as_token_ids: bool

    def __call__(self, step: Step) -> list[dict[str, Any]]:
        choice, delta = step.choice, step.delta
        echoed = step.first and choice.prompt.echo is not None
        logprobs = self._echo_logprobs(step) if echoed and self.with_logprobs else None
        text = choice.prompt.echo + delta.text if echoed else delta.text
        if echoed:
            choice.offset += len(choice.prompt.echo)
        if self.with_logprobs:
            offsets = token_offsets(choice.offset, delta.text, delta.token_ids, self.tokenizer.token_bytes)
            generated = completion_logprobs(self.tokenizer, delta.token_ids, delta.logprobs, offsets,
                                            self.as_token_ids)
            if logprobs is None:
                logprobs = generated
            else:
                extend_completion_logprobs(logprobs, generated)
        choice.offset += len(delta.text)
        pieces = []
        if text or delta.token_ids or echoed:
            pieces.append(_piece(choice.index, text, logprobs, None, None))
        if delta.finish_reason is not None:
            pieces.append(_piece(choice.index, "", empty_completion_logprobs() if self.with_logprobs else None,
                                 delta.finish_reason, delta.stop_reason))
        return pieces

    def _echo_logprobs(self, step: Step) -> dict[str, list]:
        """The prompt's tokens, first in the logprobs: the first has no logprob (null)."""
        prompt = step.choice.prompt
        entries = step.output.prompt_logprobs
        offsets = token_offsets(0, prompt.echo, prompt.token_ids, self.tokenizer.token_bytes)
        return completion_logprobs(self.tokenizer, prompt.token_ids, entries, offsets, self.as_token_ids)

    @staticmethod
    def join(index: int, pieces: list[dict[str, Any]]) -> dict[str, Any]:
        """A non-stream choice: the pieces' text and logprobs joined once."""
        logprobs = None
        for piece in pieces:
            if piece["logprobs"] is not None:
                logprobs = logprobs or empty_completion_logprobs()
                extend_completion_logprobs(logprobs, piece["logprobs"])
        final = pieces[-1] if pieces else _piece(index, "", None, None, None)
        return _piece(index, "".join(p["text"] for p in pieces), logprobs, final["finish_reason"],
                      final["stop_reason"])


def _piece(index: int, text: str, logprobs: dict | None, finish_reason: str | None,
           stop_reason: str | int | None) -> dict[str, Any]:
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason,
            "stop_reason": stop_reason}
