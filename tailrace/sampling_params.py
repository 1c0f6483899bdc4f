"""What a caller may ask of one generation: the names and meanings vLLM users already know."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

MAX_LOGPROBS = 20


class SamplingParamsError(ValueError):
    """A sampling setting is out of range; `param` names the offending field."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(slots=True)
class StructuredSpec:
    """A grammar the generated text must follow, enforced token by token in the engine core.

    Plain strings only, so that it crosses the pipe to the core as msgpack.
    """

    json_schema: str  # the JSON Schema as JSON text; '{"type": "object"}' for any object


@dataclass(slots=True)
class ThinkTokens:
    """The token ids that open and close a model's thinking. With these set, stop strings and the
    structured-output grammar apply to the answer only, not to the thinking before it."""

    open_id: int
    close_id: int
    # True: the prompt ends inside a think block, so the output starts thinking. False: the first
    # generated token decides (the open id starts thinking; anything else starts the answer).
    open_at_start: bool = False


@dataclass(slots=True)
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: no top-k cut
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    seed: int | None = None
    max_tokens: int | None = 16  # None: up to the context limit
    min_tokens: int = 0
    ignore_eos: bool = False
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    logprobs: int | None = None  # None: none; k >= 0: the sampled token plus k alternatives
    prompt_logprobs: int | None = None
    structured: StructuredSpec | None = None  # None: unconstrained
    thinking: ThinkTokens | None = None  # None: the whole output is the answer
    # "last", "mean" or "cls": the prompt's final hidden states pooled into one vector, nothing
    # generated; "score": a classifier's outputs on its first token (a cross-encoder's); "logits":
    # the last token's LogitScore (a causal reranker's)
    pooling: str | None = None
    # A pair's prompt (a cross-encoder's): the position where its second text begins, token type 1
    # from there on, as BERT's pair encoding marks it; None: one text, all type 0
    segment_start: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = [s for s in self.stop if s]
        if self.top_k == -1:
            self.top_k = 0
        self.validate()

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    def validate(self) -> None:
        _check(self.n >= 1, "n", f"n must be at least 1, got {self.n}")
        _check(math.isfinite(self.temperature) and 0.0 <= self.temperature, "temperature",
               f"temperature must be a finite number >= 0, got {self.temperature}")
        _check(0.0 < self.top_p <= 1.0, "top_p", f"top_p must be in (0, 1], got {self.top_p}")
        _check(self.top_k >= 0, "top_k", f"top_k must be -1, 0 or positive, got {self.top_k}")
        _check(0.0 <= self.min_p <= 1.0, "min_p", f"min_p must be in [0, 1], got {self.min_p}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check(math.isfinite(value) and -2.0 <= value <= 2.0, name,
                   f"{name} must be in [-2, 2], got {value}")
        _check(math.isfinite(self.repetition_penalty) and 0.0 < self.repetition_penalty <= 10.0,
               "repetition_penalty",
               f"repetition_penalty must be in (0, 10], got {self.repetition_penalty}")
        for token, bias in self.logit_bias.items():
            _check(math.isfinite(bias) and -100.0 <= bias <= 100.0, "logit_bias",
                   f"logit_bias values must be in [-100, 100], got {bias} for token {token}")
        _check(self.max_tokens is None or self.max_tokens >= 0, "max_tokens",
               f"max_tokens must be at least 0, got {self.max_tokens}")
        _check(self.pooling is None or (self.max_tokens == 0 and self.n == 1), "pooling",
               "a pooling request generates nothing: max_tokens 0 and n 1")
        _check(self.pooling in (None, "last", "mean", "cls", "score", "logits"), "pooling",
               f"pooling must be last, mean, cls, score or logits, got {self.pooling!r}")
        _check(self.min_tokens >= 0, "min_tokens", f"min_tokens must be at least 0, got {self.min_tokens}")
        _check(self.max_tokens is None or self.min_tokens <= self.max_tokens, "min_tokens",
               f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            _check(value is None or 0 <= value <= MAX_LOGPROBS, name,
                   f"{name} must be in [0, {MAX_LOGPROBS}], got {value}")


def _check(ok: bool, param: str, message: str) -> None:
    if not ok:
        raise SamplingParamsError(param, message)
