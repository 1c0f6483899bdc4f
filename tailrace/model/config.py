"""The model's shape and conventions, read from a Hugging Face `config.json` (or a GGUF file's metadata)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

from tailrace.model.gguf import config_dict, open_gguf
from tailrace.model.hub import is_gguf

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
}

# Configs built by hand (not saved from a model) name no architecture, only a model_type.
_ARCHITECTURE_BY_MODEL_TYPE = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}

SUPPORTED_ROPE_TYPES = {"llama3", "linear"}


@dataclass(slots=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None  # normalised: always has "rope_type"; None for plain RoPE
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    qk_norm: bool
    torch_dtype: str
    bos_token_id: int | None
    eos_token_ids: list[int]
    sliding_window: int | None


def load_model_config(path: str) -> ModelConfig:
    """Read `path/config.json`; stop tokens from `generation_config.json` are added when present.
    A .gguf `path` is read from its metadata instead."""
    if is_gguf(path):
        return parse_model_config(config_dict(open_gguf(path)))
    with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
        raw = json.load(f)
    config = parse_model_config(raw)
    generation_path = os.path.join(path, "generation_config.json")
    if os.path.exists(generation_path):
        with open(generation_path, encoding="utf-8") as f:
            extra = _as_id_list(json.load(f).get("eos_token_id"))
        config.eos_token_ids += [t for t in extra if t not in config.eos_token_ids]
    return config


def parse_model_config(raw: dict[str, Any]) -> ModelConfig:
    architecture = _architecture(raw)
    if raw.get("hidden_act", "silu") != "silu":
        raise ValueError(f"unsupported hidden_act {raw['hidden_act']!r}: only 'silu' is implemented")
    if raw.get("mlp_bias", False):
        raise ValueError("unsupported mlp_bias=true")
    num_heads = raw["num_attention_heads"]
    rope_theta, rope_scaling = _rope(raw)
    max_positions = raw.get("max_position_embeddings", 2048)
    sliding_window = _sliding_window(raw, architecture)
    # Attention here is always full; capping the context at the window keeps it exact.
    if sliding_window is not None and sliding_window < max_positions:
        max_positions = sliding_window
    return ModelConfig(
        architecture=architecture,
        vocab_size=raw["vocab_size"],
        hidden_size=raw["hidden_size"],
        intermediate_size=raw["intermediate_size"],
        num_hidden_layers=raw["num_hidden_layers"],
        num_attention_heads=num_heads,
        num_key_value_heads=raw.get("num_key_value_heads") or num_heads,
        head_dim=raw.get("head_dim") or raw["hidden_size"] // num_heads,
        rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        max_position_embeddings=max_positions,
        tie_word_embeddings=raw.get("tie_word_embeddings", False),
        # Qwen2 always has q/k/v biases and its config has no flag for them.
        attention_bias=architecture == "Qwen2ForCausalLM" or raw.get("attention_bias", False),
        qk_norm=architecture == "Qwen3ForCausalLM",
        torch_dtype=raw.get("dtype") or raw.get("torch_dtype") or "float32",
        bos_token_id=raw.get("bos_token_id"),
        eos_token_ids=_as_id_list(raw.get("eos_token_id")),
        sliding_window=sliding_window,
    )


def _architecture(raw: dict[str, Any]) -> str:
    names = raw.get("architectures") or [_ARCHITECTURE_BY_MODEL_TYPE.get(raw.get("model_type", ""), "")]
    name = names[0]
    if name not in SUPPORTED_ARCHITECTURES:
        shown = name or f"model_type {raw.get('model_type')!r}"
        raise ValueError(
            f"unsupported architecture {shown}; supported: {', '.join(sorted(SUPPORTED_ARCHITECTURES))}"
        )
    return name


def _rope(raw: dict[str, Any]) -> tuple[float, dict | None]:
    """(theta, scaling) from either transformers 5's `rope_parameters` or the older
    top-level `rope_theta` + `rope_scaling`."""
    params = raw.get("rope_parameters")
    if isinstance(params, dict):
        theta = params.get("rope_theta", raw.get("rope_theta", 10000.0))
        scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    else:
        theta = raw.get("rope_theta", 10000.0)
        scaling = dict(raw.get("rope_scaling") or {})
    if scaling.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError("unsupported partial_rotary_factor != 1")
    rope_type = scaling.pop("rope_type", None) or scaling.pop("type", None) or "default"
    scaling.pop("type", None)
    if rope_type == "default":
        return float(theta), None
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"unsupported rope scaling type {rope_type!r}; supported: {', '.join(sorted(SUPPORTED_ROPE_TYPES))}"
        )
    return float(theta), {"rope_type": rope_type, **scaling}


def _sliding_window(raw: dict[str, Any], architecture: str) -> int | None:
    # Qwen configs carry a window that only applies when use_sliding_window is set.
    if architecture.startswith("Qwen") and not raw.get("use_sliding_window", False):
        return None
    return raw.get("sliding_window")


def _as_id_list(value: int | list[int] | None) -> list[int]:
    if value is None:
        return []
    return [value] if isinstance(value, int) else list(value)
