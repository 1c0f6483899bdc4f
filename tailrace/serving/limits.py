"""The operator's caps on one request, and the bounded queue in front of the engine.

The schema (protocol.py) holds OpenAI's ranges; these are the server's own limits, one dataclass
filled from `tailrace serve` flags and checked before a request reaches the engine.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from tailrace.sampling_params import SamplingParams
from tailrace.serving.errors import OpenAIError, context_length_exceeded, invalid_request, rate_limited
from tailrace.serving.protocol import ChatCompletionRequest, CompletionRequest

RETRY_AFTER_S = 1  # what a refused client is told to wait: a queue slot frees within a step or so


@dataclass(slots=True)
class Limits:
    max_n: int = 16
    max_tokens: int | None = None  # None: the context length; also the default when a chat request sets none
    max_logprobs: int = 20  # alternatives per token (completions' `logprobs`, chat's `top_logprobs`)
    max_stop_sequences: int = 4  # OpenAI's own cap; raise it with --max-stop-sequences
    max_stop_chars: int = 256  # per stop string: longer ones only make the detokenizer hold text back
    max_prompt_tokens: int | None = None  # None: the context length
    max_num_seqs: int = 64  # the engine runs this many sequences at once (its --max-num-seqs)
    max_waiting_seqs: int = 256  # sequences allowed to queue behind those; more answer 429
    request_timeout_s: float | None = None  # None: no limit

    def validate(self) -> None:
        for name in ("max_n", "max_num_seqs"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1")
        for name in ("max_logprobs", "max_stop_sequences", "max_stop_chars", "max_waiting_seqs"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must not be negative")
        for name in ("max_tokens", "max_prompt_tokens", "request_timeout_s"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(f"{name} must be positive")


def check_request_limits(limits: Limits, request: CompletionRequest | ChatCompletionRequest) -> None:
    """400 for a request over a cap that its prompt does not affect."""
    _at_most("n", request.n, limits.max_n)
    if limits.max_tokens is not None and request.effective_max_tokens is not None:
        named = isinstance(request, ChatCompletionRequest) and request.max_completion_tokens is not None
        _at_most("max_completion_tokens" if named else "max_tokens", request.effective_max_tokens, limits.max_tokens)
    if limits.max_tokens is not None:
        _at_most("min_tokens", request.min_tokens, limits.max_tokens)
    if isinstance(request, CompletionRequest):
        if request.logprobs is not None:
            _at_most("logprobs", request.logprobs, limits.max_logprobs)
    elif request.top_logprobs is not None:
        _at_most("top_logprobs", request.top_logprobs, limits.max_logprobs)
    stops = [request.stop] if isinstance(request.stop, str) else request.stop or []
    if len(stops) > limits.max_stop_sequences:
        raise invalid_request(f"Invalid 'stop': array too long. Expected an array with maximum length "
                              f"{limits.max_stop_sequences}, but got an array with length {len(stops)} instead.",
                              param="stop", code="array_above_max_length")
    longest = max(map(len, stops), default=0)
    if longest > limits.max_stop_chars:
        raise invalid_request(f"Invalid 'stop': string too long. Expected a string with maximum length "
                              f"{limits.max_stop_chars}, but got a string with length {longest} instead.",
                              param="stop", code="string_above_max_length")


def check_prompt_limits(limits: Limits, prompt_lengths: list[int], chat: bool) -> None:
    """400 (a context overflow, as clients classify it) for a prompt over --max-prompt-tokens."""
    if limits.max_prompt_tokens is None:
        return
    for length in prompt_lengths:
        if length > limits.max_prompt_tokens:
            raise context_length_exceeded(limits.max_prompt_tokens, length, chat)


def cap_max_tokens(limits: Limits, params: SamplingParams) -> None:
    """A request that set no max_tokens (chat: up to the context; completions: 16) gets at most the cap."""
    if limits.max_tokens is not None and (params.max_tokens is None or params.max_tokens > limits.max_tokens):
        params.max_tokens = limits.max_tokens


def _at_most(param: str, value: int, limit: int) -> None:
    if value > limit:
        raise invalid_request(f"Invalid '{param}': integer above maximum value. Expected a value <= {limit}, "
                              f"but got {value} instead.", param=param, code="integer_above_max_value")


class Admission:
    """Counts the sequences (one per choice) of the requests being served. Beyond the ones the
    engine runs at once plus the waiting room, a new request is refused with 429 at once rather
    than queued without bound: its client can retry elsewhere or later."""

    def __init__(self, limits: Limits) -> None:
        self.capacity = limits.max_num_seqs + limits.max_waiting_seqs
        self.in_flight = 0

    @contextmanager
    def hold(self, num_seqs: int) -> Iterator[None]:
        if self.in_flight + num_seqs > self.capacity:
            raise _queue_full(self.capacity)
        self.in_flight += num_seqs
        try:
            yield
        finally:
            self.in_flight -= num_seqs


def _queue_full(capacity: int) -> OpenAIError:
    error = rate_limited(f"The server is at capacity ({capacity} sequences running or waiting). "
                         f"Please retry after {RETRY_AFTER_S} s.")
    error.headers["retry-after"] = str(RETRY_AFTER_S)
    return error
