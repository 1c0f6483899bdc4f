"""What the serving side and the engine core exchange: a request in, each sequence's gains of a
step out. Plain data without PyTorch, so the API process, which only sends and receives these,
never loads it."""

from __future__ import annotations

from dataclasses import dataclass, field

from tailrace.outputs import TokenLogprob
from tailrace.sampling_params import SamplingParams


@dataclass(slots=True)
class EngineRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams


@dataclass(slots=True)
class SeqOutput:
    """What one sequence gained in one step."""

    request_id: str
    sibling: int
    new_token_ids: list[int] = field(default_factory=list)
    new_logprobs: list[TokenLogprob] | None = None
    finish_reason: str | None = None  # "stop" (eos or stop token) | "length" | "abort"
    stop_reason: int | None = None
    num_cached_tokens: int = 0
    prompt_logprobs: list[TokenLogprob] | None = None  # one per prompt token after the first
    embedding: list[float] | None = None  # a pooling request's vector, once its prompt is computed
