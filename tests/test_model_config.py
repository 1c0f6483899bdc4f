"""Reading Hugging Face config.json files into ModelConfig."""

from __future__ import annotations

import json

import pytest

from tailrace.model.config import load_model_config, parse_model_config

BASE = {
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
}


def parse(**changes):
    return parse_model_config({**BASE, **changes})


def test_transformers5_rope_parameters_give_theta_and_scaling():
    rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    config = parse(rope_parameters=rope)
    assert config.rope_theta == 500000.0
    assert config.rope_scaling == {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                   "high_freq_factor": 4.0, "original_max_position_embeddings": 64}


def test_legacy_rope_scaling_with_type_key_is_normalised():
    config = parse(rope_theta=1e6, rope_scaling={"type": "linear", "factor": 2.0})
    assert (config.rope_theta, config.rope_scaling) == (1e6, {"rope_type": "linear", "factor": 2.0})


def test_default_rope_type_means_no_scaling():
    assert parse(rope_parameters={"rope_type": "default", "rope_theta": 10000.0}).rope_scaling is None


def test_unknown_rope_type_is_rejected():
    with pytest.raises(ValueError, match="yarn"):
        parse(rope_scaling={"rope_type": "yarn", "factor": 4.0})


def test_unsupported_architecture_is_rejected_by_name():
    with pytest.raises(ValueError, match="GPT2LMHeadModel"):
        parse(architectures=["GPT2LMHeadModel"])


def test_architecture_falls_back_to_model_type():
    raw = {k: v for k, v in BASE.items() if k != "architectures"}
    assert parse_model_config({**raw, "model_type": "qwen3"}).architecture == "Qwen3ForCausalLM"


def test_head_dim_defaults_to_hidden_over_heads():
    assert parse().head_dim == 16


def test_key_value_heads_default_to_attention_heads():
    raw = {k: v for k, v in BASE.items() if k != "num_key_value_heads"}
    assert parse_model_config(raw).num_key_value_heads == 4


def test_qwen2_always_has_attention_bias():
    assert parse(architectures=["Qwen2ForCausalLM"]).attention_bias


def test_qwen3_uses_qk_norm_and_llama_does_not():
    assert parse(architectures=["Qwen3ForCausalLM"]).qk_norm
    assert not parse().qk_norm


def test_mistral_sliding_window_caps_the_context():
    config = parse(architectures=["MistralForCausalLM"], sliding_window=128)
    assert (config.sliding_window, config.max_position_embeddings) == (128, 128)


def test_qwen_sliding_window_ignored_unless_enabled():
    config = parse(architectures=["Qwen2ForCausalLM"], sliding_window=128, use_sliding_window=False)
    assert (config.sliding_window, config.max_position_embeddings) == (None, 512)


def test_single_eos_id_becomes_a_list():
    assert parse(eos_token_id=2).eos_token_ids == [2]


def test_dtype_is_read_from_either_key():
    assert parse(dtype="bfloat16").torch_dtype == "bfloat16"
    assert parse(torch_dtype="float16").torch_dtype == "float16"


def test_non_silu_activation_is_rejected():
    with pytest.raises(ValueError, match="gelu"):
        parse(hidden_act="gelu")


def test_generation_config_adds_stop_tokens(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({**BASE, "eos_token_id": 2}))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7]}))
    assert load_model_config(str(tmp_path)).eos_token_ids == [2, 7]
