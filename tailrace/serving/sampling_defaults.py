"""The model's recommended sampling settings (its `generation_config.json`) as the defaults of
requests that leave them unset, as vLLM's `--generation-config auto` does: `auto` reads the
model's file, `vllm` ignores it (OpenAI's defaults), a directory reads that directory's file."""

from __future__ import annotations

import json
import os
from typing import TypeVar

from pydantic import BaseModel

# generation_config.json key -> request field. transformers' own defaults (temperature 1.0, top_p
# 1.0, top_k 50, repetition_penalty 1.0) are what a saved file repeats without recommending
# them; like vLLM, they are not taken as the model's wish.
_FIELDS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
           "repetition_penalty": "repetition_penalty"}
_TRANSFORMERS_DEFAULTS = {"temperature": 1.0, "top_p": 1.0, "top_k": 50, "repetition_penalty": 1.0}

R = TypeVar("R", bound=BaseModel)


def load_sampling_defaults(source: str, model_path: str) -> dict[str, float]:
    """Request field -> default, from `source`: "auto" (the model's directory), "vllm" (none) or a
    directory holding a generation_config.json."""
    if source == "vllm":
        return {}
    directory = model_path if source == "auto" else source
    if source != "auto" and not os.path.isdir(directory):
        raise ValueError(f"--generation-config {source!r}: not a directory (nor auto or vllm)")
    path = os.path.join(directory, "generation_config.json")
    if not os.path.isfile(path):
        if source != "auto":
            raise ValueError(f"--generation-config: no generation_config.json in {directory}")
        return {}
    with open(path, encoding="utf-8") as f:
        config = json.load(f)
    return {field: config[key] for key, field in _FIELDS.items()
            if isinstance(config.get(key), (int, float)) and config[key] != _TRANSFORMERS_DEFAULTS.get(key)}


def with_sampling_defaults(request: R, defaults: dict[str, float]) -> R:
    """The request with the defaults filled in where the client set nothing."""
    unset = {name: value for name, value in defaults.items() if name not in request.model_fields_set}
    return request.model_copy(update=unset) if unset else request
