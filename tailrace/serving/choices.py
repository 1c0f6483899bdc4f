"""One HTTP request's generation: per-prompt engine streams merged into per-choice steps.

Both endpoints run on this: the engine's deltas become `Step`s in the order the client must see
them (choices introduced in ascending index), each endpoint turns a step into choice objects
("pieces"), and a stream wraps each piece in a chunk while a non-stream response joins them. Both
paths see the same pieces, so they cannot disagree.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterable
from contextlib import AbstractContextManager, aclosing, nullcontext
from dataclasses import dataclass, field
from typing import Any, Protocol

from tailrace.engine.client import EngineClient, EngineDeadError, RequestFailedError, RequestRejectedError
from tailrace.outputs import CompletionOutput, RequestOutput
from tailrace.sampling_params import SamplingParams
from tailrace.serving.context import RequestContext
from tailrace.serving.errors import (
    completion_budget_exceeded, context_length_exceeded, engine_unavailable, internal, invalid_request,
    request_timeout, unsupported_parameter,
)
from tailrace.serving.limits import cap_max_tokens, check_prompt_limits, check_request_limits
from tailrace.serving.protocol import ChatCompletionRequest, CompletionRequest, unsupported_fields


@dataclass(slots=True)
class Prompt:
    token_ids: list[int]
    params: SamplingParams
    echo: str | None = None  # text sent ahead of each of its choices; None: no echo


@dataclass(slots=True)
class ChoiceState:
    """Everything one choice's stream remembers; n>1 siblings never share one."""

    index: int
    prompt: Prompt
    offset: int = 0  # characters of this choice's returned text so far, echo included
    generated: int = 0  # tokens generated so far
    introduced: bool = False
    last_token_at: float | None = None
    held: list[RequestOutput] = field(default_factory=list)  # waiting for a lower index to start


@dataclass(slots=True)
class Step:
    """One engine delta of one choice, released in client order."""

    choice: ChoiceState
    output: RequestOutput  # its one CompletionOutput is `delta`
    first: bool  # the choice's first step: echo (and chat's role) go out with it

    @property
    def delta(self) -> CompletionOutput:
        return self.output.outputs[0]


@dataclass(slots=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int = 0
    cached_per_prompt: list[int] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens,
                "prompt_tokens_details": {"cached_tokens": sum(self.cached_per_prompt)}}


def check_context(prompt_len: int, max_tokens: int | None, max_model_len: int, chat: bool,
                  max_tokens_param: str = "max_tokens") -> None:
    """A prompt that leaves no room to generate is a context overflow (as clients classify it); one
    that fits, with max_tokens over the room left, is a max_tokens error naming that room."""
    if prompt_len > max_model_len or (prompt_len == max_model_len and max_tokens != 0):
        raise context_length_exceeded(max_model_len, prompt_len, chat)
    if max_tokens is not None and prompt_len + max_tokens > max_model_len:
        raise completion_budget_exceeded(max_model_len, prompt_len, max_tokens, max_tokens_param)


def check_token_ids(token_ids: list[int], vocab_size: int | None, param: str) -> None:
    if not token_ids:
        raise invalid_request(f"The {param} must contain at least one token.", param=param)
    if vocab_size is not None:
        check_vocab(token_ids, vocab_size, param)


def check_vocab(token_ids: Iterable[int], vocab_size: int, param: str) -> None:
    """Every id names a token (the schema already refuses negative ones)."""
    bad = next((t for t in token_ids if t >= vocab_size), None)
    if bad is not None:
        raise invalid_request(f"Token id {bad} is out of range: the vocabulary has {vocab_size} tokens.",
                              param=param)


def check_request(engine: EngineClient, request: CompletionRequest | ChatCompletionRequest) -> None:
    """What refuses a request whatever its prompt: a field this server does not serve, a dead engine."""
    unsupported = unsupported_fields(request)
    if unsupported is not None:
        raise unsupported_parameter(unsupported)
    vocab_size = engine.tokenizer.vocab_size
    check_vocab(request.stop_token_ids or [], vocab_size, "stop_token_ids")
    check_vocab(request.logit_bias or {}, vocab_size, "logit_bias")
    if engine.errored:
        raise engine_unavailable()


def envelope(id_prefix: str, object_name: str, ctx: RequestContext) -> dict[str, Any]:
    """The fields every chunk (and the non-stream response) repeats; the id reuses the request's hex."""
    return {"id": f"{id_prefix}-{ctx.request_id.removeprefix('req-')}", "object": object_name,
            "created": int(time.time()), "model": ctx.model_name}


class Generation:
    """The engine requests of one HTTP request (one per prompt, each fanning out into n siblings)."""

    def __init__(self, engine: EngineClient, request_id: str, prompts: list[Prompt], ctx: RequestContext) -> None:
        self.engine = engine
        self.request_id = request_id
        self.prompts = prompts
        self.ctx = ctx
        self.metrics = ctx.metrics
        self.started_at = time.monotonic()
        timeout = ctx.limits.request_timeout_s
        self.deadline = None if timeout is None else asyncio.get_running_loop().time() + timeout
        n = prompts[0].params.n
        self.choices = [ChoiceState(p * n + j, prompt) for p, prompt in enumerate(prompts) for j in range(n)]
        self.usage = Usage(sum(len(p.token_ids) for p in prompts), cached_per_prompt=[0] * len(prompts))
        self._n = n
        self._next_intro = 0  # lowest choice index not introduced yet
        self._first_token_seen = False

    def engine_request_id(self, prompt_index: int) -> str:
        return f"{self.request_id}-{prompt_index}"

    async def steps(self) -> AsyncIterator[Step]:
        """Every delta of every choice, choices introduced in ascending index; ends when all finished.

        Holds the request's place in the server's queue while it runs (429 when there is none),
        and fails with an OpenAIError when the request times out or the engine refuses or loses it.
        """
        with self._admission():
            async with aclosing(self._merged()) as merged:
                while (item := await self._next(merged)) is not None:
                    prompt_index, output = item
                    choice = self.choices[prompt_index * self._n + output.outputs[0].index]
                    self._observe(choice, output)
                    for step in self._admit(choice, output):
                        self._account(step)
                        yield step
        self._finish_metrics()

    def _admission(self) -> AbstractContextManager[None]:
        admission = self.ctx.admission
        return nullcontext() if admission is None else admission.hold(len(self.choices))

    async def _next(self, merged: AsyncIterator[tuple[int, RequestOutput]]) -> tuple[int, RequestOutput] | None:
        """The next delta, or None at the end. The deadline covers one await and no yield, so the
        timeout's cancellation lands inside the engine streams, which then abort their requests."""
        try:
            if self.deadline is None:
                return await anext(merged, None)
            return await asyncio.wait_for(anext(merged, None), self.deadline - asyncio.get_running_loop().time())
        except asyncio.TimeoutError:
            raise request_timeout(self.ctx.limits.request_timeout_s) from None
        except RequestRejectedError as err:
            raise invalid_request(str(err), param=err.param) from None
        except RequestFailedError:
            raise internal() from None  # the engine client logged the fault; the client gets no details
        except EngineDeadError as err:
            raise engine_unavailable("The engine stopped. Please retry shortly.") from err

    def _admit(self, choice: ChoiceState, output: RequestOutput) -> list[Step]:
        if choice.index > self._next_intro:
            choice.held.append(output)
            return []
        steps = [self._step(choice, output)]
        if choice.index == self._next_intro:
            self._next_intro += 1
            while self._next_intro < len(self.choices) and self.choices[self._next_intro].held:
                later = self.choices[self._next_intro]
                steps += [self._step(later, held) for held in later.held]
                later.held.clear()
                self._next_intro += 1
        return steps

    @staticmethod
    def _step(choice: ChoiceState, output: RequestOutput) -> Step:
        first = not choice.introduced
        choice.introduced = True
        return Step(choice, output, first)

    def _account(self, step: Step) -> None:
        """Usage as of what the client has been sent (continuous usage reads it per chunk)."""
        delta = step.delta
        self.usage.completion_tokens += len(delta.token_ids)
        step.choice.generated += len(delta.token_ids)
        if step.first:
            p = step.choice.index // self._n
            self.usage.cached_per_prompt[p] = max(self.usage.cached_per_prompt[p], step.output.num_cached_tokens)
        if self.metrics is None:
            return
        # Counted as they are generated, so the counters (and the stats log's throughput) move
        # during a long stream; a prompt counts once, when its first choice starts.
        prompt_tokens = len(step.choice.prompt.token_ids) if step.first and step.choice.index % self._n == 0 else 0
        self.metrics.add_tokens(prompt_tokens, len(delta.token_ids))
        if delta.finish_reason is not None:
            self.metrics.count_finish(delta.finish_reason, len(step.choice.prompt.token_ids), step.choice.generated)

    def _observe(self, choice: ChoiceState, output: RequestOutput) -> None:
        if self.metrics is None or not output.outputs[0].token_ids:
            return
        now = time.monotonic()
        if not self._first_token_seen:
            self._first_token_seen = True
            self.metrics.observe_ttft(now - self.started_at)
        elif choice.last_token_at is not None:
            self.metrics.observe_itl(now - choice.last_token_at)
        choice.last_token_at = now

    def _finish_metrics(self) -> None:
        if self.metrics is not None:
            self.metrics.observe_e2e(time.monotonic() - self.started_at)

    async def _merged(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(prompt index, delta) from all prompts' engine streams as they arrive. Closing this
        (the client went away, or a task was cancelled) closes and aborts every unfinished one."""
        streams = [self.engine.add_request(self.engine_request_id(p), prompt.token_ids, prompt.params)
                   for p, prompt in enumerate(self.prompts)]
        finished = [False] * len(streams)
        pending: dict[asyncio.Task, int] = {}
        try:
            if len(streams) == 1:
                async for output in streams[0]:
                    finished[0] = output.finished
                    yield 0, output
                return
            pending = {asyncio.create_task(_next_or_none(s)): p for p, s in enumerate(streams)}
            while pending:
                done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for task in sorted(done, key=pending.__getitem__):
                    p = pending.pop(task)
                    output = task.result()
                    if output is None:
                        continue
                    finished[p] = output.finished
                    pending[asyncio.create_task(_next_or_none(streams[p]))] = p
                    yield p, output
        finally:
            await _cancel(pending)
            for p, stream in enumerate(streams):
                await stream.aclose()
                if not finished[p]:
                    await self.engine.abort(self.engine_request_id(p))


async def _next_or_none(stream: AsyncIterator[RequestOutput]) -> RequestOutput | None:
    return await anext(stream, None)


async def _cancel(tasks: dict[asyncio.Task, int]) -> None:
    for task in tasks:
        task.cancel()
    if tasks:
        await asyncio.gather(*tasks, return_exceptions=True)


# ---- the two ways out: chunks or one joined response ------------------------------------------

class Pieces(Protocol):
    """An endpoint's view of a step: the choice objects it adds, and how they join."""

    def __call__(self, step: Step) -> list[dict[str, Any]]: ...

    def join(self, index: int, pieces: list[dict[str, Any]]) -> dict[str, Any]: ...


async def respond(generation: Generation, pieces_of: Pieces, request: CompletionRequest | ChatCompletionRequest,
                  head: dict[str, Any], full_object: str) -> dict[str, Any] | AsyncIterator[dict[str, Any]]:
    """The chunk iterator for a stream; otherwise the whole response, `head` with `full_object`."""
    limits = generation.ctx.limits
    check_request_limits(limits, request)
    chat = isinstance(request, ChatCompletionRequest)
    check_prompt_limits(limits, [len(p.token_ids) for p in generation.prompts], chat)
    for prompt in generation.prompts:
        cap_max_tokens(limits, prompt.params)
    if request.stream:
        return stream_chunks(generation, pieces_of, head, request.include_usage,
                             request.include_usage and request.continuous_usage_stats)
    by_choice = await collect_pieces(generation, pieces_of)
    return {**head, "object": full_object, "choices": [pieces_of.join(i, p) for i, p in enumerate(by_choice)],
            "usage": generation.usage.as_dict()}


async def stream_chunks(generation: Generation, pieces_of: Pieces, head: dict[str, Any],
                        include_usage: bool, continuous_usage: bool) -> AsyncIterator[dict[str, Any]]:
    """One choice per chunk; with include_usage, one `choices: []` usage chunk after all others
    (and, with continuous_usage, the running usage on every chunk as vLLM does)."""
    async with aclosing(generation.steps()) as steps:
        async for step in steps:
            for piece in pieces_of(step):
                chunk = {**head, "choices": [piece]}
                if continuous_usage:
                    chunk["usage"] = generation.usage.as_dict()
                yield chunk
    if include_usage:
        yield {**head, "choices": [], "usage": generation.usage.as_dict()}


async def collect_pieces(generation: Generation, pieces_of: Pieces) -> list[list[dict[str, Any]]]:
    """Every piece of every choice, by choice index, for a non-stream response to join once."""
    by_choice: list[list[dict[str, Any]]] = [[] for _ in generation.choices]
    async with aclosing(generation.steps()) as steps:
        async for step in steps:
            by_choice[step.choice.index].extend(pieces_of(step))
    return by_choice
