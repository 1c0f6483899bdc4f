"""`--speculative-config`, read as vLLM reads it: a JSON object (or a dict from `LLM(...)`)."""

from __future__ import annotations

import json
from dataclasses import dataclass

METHODS = ("ngram", "draft_model")
# vLLM's default window when neither bound is given.
DEFAULT_LOOKUP = 5


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    method: str  # "ngram": prompt lookup; "draft_model": a smaller model's greedy tokens
    num_speculative_tokens: int  # the most tokens proposed per sequence per step
    prompt_lookup_min: int = DEFAULT_LOOKUP  # ngram: the shortest suffix of the sequence looked up
    prompt_lookup_max: int = DEFAULT_LOOKUP  # ngram: the longest
    model: str | None = None  # draft_model: its directory, GGUF file or hub id


def parse_speculative_config(value: str | dict | SpeculativeConfig | None) -> SpeculativeConfig | None:
    """The config from its JSON text or dict; ValueError naming the key that is wrong."""
    if value is None or isinstance(value, SpeculativeConfig):
        return value
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"--speculative-config is not JSON: {e}") from None
    if not isinstance(value, dict):
        raise ValueError("the speculative config must be a JSON object, e.g. "
                         '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}')
    given = dict(value)
    method = given.pop("method", None)
    if method == "[ngram]":  # vLLM's older spelling
        method = "ngram"
    model = given.pop("model", None)
    if method is None and model is not None:  # vLLM's default with a model
        method = "draft_model"
    if method not in METHODS:
        raise ValueError(f"speculative method {method!r} is not served; served: {', '.join(METHODS)}")
    k = _positive(given.pop("num_speculative_tokens", None), "num_speculative_tokens", required=True)
    if method == "draft_model":
        if not isinstance(model, str) or not model:
            raise ValueError('a draft model needs "model": its directory, GGUF file or hub id')
        if given:
            raise ValueError(f"unknown speculative config keys for a draft model: {', '.join(sorted(given))}")
        return SpeculativeConfig(method, k, model=model)
    if model is not None:
        raise ValueError('"model" names a draft model; the ngram method takes none')
    low = _positive(given.pop("prompt_lookup_min", None), "prompt_lookup_min")
    high = _positive(given.pop("prompt_lookup_max", None), "prompt_lookup_max")
    if low is None and high is None:
        low = high = DEFAULT_LOOKUP
    low, high = low or high, high or low
    if low > high:
        raise ValueError(f"prompt_lookup_min ({low}) is over prompt_lookup_max ({high})")
    if given:
        raise ValueError(f"unknown speculative config keys for method {method!r}: {', '.join(sorted(given))}")
    return SpeculativeConfig(method, k, low, high)


def _positive(value: object, name: str, required: bool = False) -> int | None:
    if value is None:
        if required:
            raise ValueError(f"the speculative config needs {name}")
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, not {value!r}")
    return value
