"""What generation returns: whole results offline, deltas when streamed."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class TokenLogprob:
    """The log-probability of one chosen token and the best alternatives at its position."""

    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)  # (token id, logprob), best first


@dataclass(slots=True)
class CompletionOutput:
    """One choice. From the async client it is a delta: only what is new since the last one."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: str | int | None = None  # the matched stop string or stop token id
    embedding: list[float] | None = None  # a pooling request's vector, with its finish

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    prompt: str | None = None
    # One entry per prompt token; the first is None (nothing precedes it).
    prompt_logprobs: list[TokenLogprob | None] | None = None
    num_cached_tokens: int = 0
