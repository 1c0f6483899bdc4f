"""One tiny config.json per architecture tailrace serves, for tests that parse or build one: the
same small shape (64 wide, 2 layers, 4 heads of 16 over 2 KV heads) with what each architecture's
config needs besides. A test changes what it checks with `tiny(name, **changes)`."""

from __future__ import annotations

from typing import Any

TINY = {"vocab_size": 256, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 512}
_GEMMA = {"query_pre_attn_scalar": 144, "head_dim": 16, "sliding_window": 64}

# name -> (Hugging Face class, model_type, what its config needs besides the shape)
_ROWS: dict[str, tuple[str, str, dict[str, Any]]] = {
    "llama": ("LlamaForCausalLM", "llama", {}),
    "mistral": ("MistralForCausalLM", "mistral", {}),
    "qwen2": ("Qwen2ForCausalLM", "qwen2", {}),
    "qwen3": ("Qwen3ForCausalLM", "qwen3", {}),
    "smollm3": ("SmolLM3ForCausalLM", "smollm3", {}),
    "gemma2": ("Gemma2ForCausalLM", "gemma2", _GEMMA),
    "gemma3": ("Gemma3ForCausalLM", "gemma3_text", _GEMMA),
    "phi3": ("Phi3ForCausalLM", "phi3", {}),
    "qwen3_moe": ("Qwen3MoeForCausalLM", "qwen3_moe",
                  {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32}),
    "mixtral": ("MixtralForCausalLM", "mixtral", {"num_local_experts": 4, "num_experts_per_tok": 2}),
    "gpt_oss": ("GptOssForCausalLM", "gpt_oss",
                {"num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": 128, "attention_bias": True}),
    "granite": ("GraniteForCausalLM", "granite", {}),
    "olmo2": ("Olmo2ForCausalLM", "olmo2", {}),
}
ARCHITECTURES = {name: {"architectures": [cls], "model_type": model_type, **TINY, **extra}
                 for name, (cls, model_type, extra) in _ROWS.items()}


def tiny(name: str, **changes: Any) -> dict[str, Any]:
    """The architecture's tiny config with `changes` over it (a copy)."""
    return {**ARCHITECTURES[name], **changes}


def hf_names(name: str) -> dict[str, str]:
    """The architecture's Hugging Face class and model_type, as a bench Shape names them."""
    cls, model_type, _ = _ROWS[name]
    return {"architecture": cls, "model_type": model_type}
