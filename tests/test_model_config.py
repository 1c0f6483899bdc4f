"""Reading Hugging Face config.json files into ModelConfig."""

from __future__ import annotations

import json
import math

import pytest
import torch

from architectures import ARCHITECTURES, tiny
from tailrace.model.decoder.config import limit_context, parse_model_config
from tailrace.model.loading.loader import load_model_config

BASE = ARCHITECTURES["llama"]


def parse(name: str = "llama", **changes):
    """The tiny config of architecture `name` (tests/architectures.py) with `changes`, parsed."""
    return parse_model_config(tiny(name, **changes))


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


def test_unknown_rope_type_is_rejected_naming_the_supported():
    with pytest.raises(ValueError, match="'dynamic'; supported: linear, llama3, longrope, proportional, yarn"):
        parse(rope_scaling={"rope_type": "dynamic", "factor": 4.0})


def test_yarn_attention_factor_from_the_factor_or_the_mscales():
    yarn = {"rope_type": "yarn", "factor": 32.0, "original_max_position_embeddings": 4096}
    assert parse(rope_scaling=yarn).rope_scaling["attention_factor"] == pytest.approx(0.1 * math.log(32) + 1)
    scaled = parse(rope_scaling={**yarn, "mscale": 2.0, "mscale_all_dim": 1.0}).rope_scaling
    assert scaled["attention_factor"] == pytest.approx((0.2 * math.log(32) + 1) / (0.1 * math.log(32) + 1))


def test_gpt_oss_experts_sinks_and_biases():
    config = parse("gpt_oss", num_local_experts=32, num_experts_per_tok=4,
                   attention_bias=True, sliding_window=128, layer_types=["sliding_attention", "full_attention"])
    assert (config.num_experts, config.experts_per_token, config.moe_intermediate_size) == (32, 4, 128)
    assert config.layer_moe == [True, True] and config.layer_windows == [128, None]
    assert (config.hidden_act, config.swiglu_alpha, config.swiglu_limit) == ("swiglu_oai", 1.702, 7.0)
    assert config.attention_sinks and config.attention_out_bias and config.moe_bias and config.router_topk_first


def test_gpt_oss_without_layer_types_alternates_windows_from_the_first_layer():
    """transformers' GptOssConfig default, as llama.cpp's gpt-oss hard-codes it."""
    config = parse("gpt_oss", num_hidden_layers=4)  # its row's sliding_window: 128
    assert config.layer_windows == [128, None, 128, None]


def test_a_moe_picking_more_experts_than_it_has_is_refused():
    with pytest.raises(ValueError, match="num_experts_per_tok 9"):
        parse("qwen3_moe", num_experts=8, num_experts_per_tok=9, moe_intermediate_size=16)


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
    assert parse("qwen2").attention_bias


def test_attention_bias_gives_llama_an_o_proj_bias_and_qwen2_none():
    """transformers' Llama (and OLMo 2, Granite, SmolLM3) biases o_proj with q/k/v; Qwen2's
    always-on biases are q/k/v only."""
    for name in ("llama", "olmo2", "granite", "smollm3"):
        config = parse(name, attention_bias=True)
        assert config.attention_bias and config.attention_out_bias
    qwen2 = parse("qwen2")
    assert qwen2.attention_bias and not qwen2.attention_out_bias
    assert not parse().attention_out_bias


def test_qwen3_uses_qk_norm_and_llama_does_not():
    assert parse("qwen3").qk_norm
    assert not parse().qk_norm


def test_mistral_sliding_window_is_every_layers_and_keeps_the_context():
    config = parse("mistral", sliding_window=128)
    assert (config.layer_windows, config.max_position_embeddings) == ([128, 128], 512)


def test_a_window_as_long_as_the_context_is_no_window():
    assert parse("mistral", sliding_window=512).layer_windows == [None, None]


def test_qwen_sliding_window_ignored_unless_enabled():
    config = parse("qwen2", sliding_window=128, use_sliding_window=False)
    assert (config.layer_windows, config.max_position_embeddings) == ([None, None], 512)


def test_gemma2_alternates_windows_from_the_first_layer_and_caps_scores_and_logits():
    config = parse("gemma2", attn_logit_softcapping=50.0, final_logit_softcapping=30.0,
                   hidden_activation="gelu_pytorch_tanh", num_hidden_layers=4)
    assert config.layer_windows == [64, None, 64, None]
    assert (config.attention_softcap, config.final_logit_softcap) == (50.0, 30.0)
    assert (config.hidden_act, config.norm_weight_offset, config.norm_style) == ("gelu_tanh", 1.0, "sandwich")
    assert config.attention_scale == 144**-0.5 and config.embedding_multiplier == 64**0.5
    assert config.tie_word_embeddings  # Gemma's default


def test_gemma3_old_config_sliding_pattern_and_local_rope_base():
    config = parse("gemma3", num_hidden_layers=7, sliding_window_pattern=3, rope_theta=1e6,
                   rope_local_base_freq=1e4, rope_scaling={"rope_type": "linear", "factor": 8.0})
    assert config.layer_windows == [64, 64, None, 64, 64, None, 64]
    assert config.layer_rope == ["local", "local", "global", "local", "local", "global", "local"]
    assert (config.rope_theta, config.local_rope_theta) == (1e6, 1e4)
    assert config.rope_scaling == {"rope_type": "linear", "factor": 8.0}
    assert config.qk_norm and config.attention_softcap is None


def test_gemma3_transformers5_config_has_rope_parameters_per_layer_type():
    rope = {"full_attention": {"rope_type": "default", "rope_theta": 1e6},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}
    config = parse("gemma3", architectures=None, rope_parameters=rope,
                   layer_types=["full_attention", "sliding_attention"])
    assert config.architecture == "Gemma3ForCausalLM"
    assert (config.layer_rope, config.layer_windows) == (["global", "local"], [None, 64])
    assert (config.rope_theta, config.rope_scaling, config.local_rope_theta) == (1e6, None, 1e4)


def test_smollm3_layers_without_rope_from_the_list_or_the_interval():
    assert parse("smollm3", no_rope_layers=[0, 1]).layer_rope == [None, "global"]
    config = parse("smollm3", num_hidden_layers=8, no_rope_layer_interval=4,
                   sliding_window=128)
    assert config.layer_rope == ["global"] * 3 + [None] + ["global"] * 3 + [None]
    assert config.layer_windows == [None] * 8  # SmolLM3's window applies only with use_sliding_window


def test_phi3_partial_rotary_and_longrope_factors_chosen_by_the_context_served():
    rope = {"rope_type": "longrope", "rope_theta": 1e4, "partial_rotary_factor": 0.75,
            "long_factor": [2.0] * 6, "short_factor": [1.0] * 6}
    config = parse("phi3", head_dim=16, max_position_embeddings=4096,
                   original_max_position_embeddings=1024, rope_parameters=rope)
    assert (config.rotary_dim, config.head_dim) == (12, 16)
    scaling = config.rope_scaling
    assert scaling["attention_factor"] == pytest.approx(math.sqrt(1 + math.log(4) / math.log(1024)))
    assert scaling["long"]  # the whole 4096 served: past the pretrained 1024
    limit_context(config, 1024)
    assert (config.max_position_embeddings, scaling["long"]) == (1024, False)


def test_a_partial_rotary_of_an_odd_width_is_refused():
    with pytest.raises(ValueError, match="partial rotary: 5 of 16"):
        parse("phi3", head_dim=16, partial_rotary_factor=5 / 16)


def test_granite_multipliers_and_olmo2_norms():
    granite = parse("granite", embedding_multiplier=12.0, residual_multiplier=0.22,
                    attention_multiplier=0.0078125, logits_scaling=8.0)
    assert (granite.embedding_multiplier, granite.residual_multiplier, granite.attention_scale,
            granite.logit_divisor) == (12.0, 0.22, 0.0078125, 8.0)
    olmo2 = parse("olmo2")
    assert (olmo2.norm_style, olmo2.qk_norm, olmo2.qk_norm_over_heads) == ("post", True, True)
    assert (parse().norm_style, parse().residual_multiplier) == ("pre", 1.0)


def test_gemma3_multimodal_config_is_its_text_models_with_gemma3s_defaults_filled_in():
    """gemma-3-4b-it's config.json: text_config names only what differs from the defaults."""
    config = parse_model_config({
        "architectures": ["Gemma3ForConditionalGeneration"], "eos_token_id": [1, 106], "torch_dtype": "bfloat16",
        "text_config": {"hidden_size": 2560, "intermediate_size": 10240, "model_type": "gemma3_text",
                        "num_hidden_layers": 34, "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
                        "sliding_window": 1024},
        "vision_config": {"model_type": "siglip_vision_model"}})
    assert config.architecture == "Gemma3ForCausalLM" and config.torch_dtype == "bfloat16"
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim, config.vocab_size) == (
        8, 4, 256, 262208)
    assert config.eos_token_ids == [1, 106] and config.tie_word_embeddings
    assert config.layer_windows[:6] == [1024] * 5 + [None] and config.layer_rope[5] == "global"
    assert (config.rope_theta, config.local_rope_theta, config.rope_scaling["factor"]) == (1e6, 1e4, 8.0)


# An E2B-like Gemma 4 as its image-text checkpoint's config.json holds it (global_head_dim, not
# transformers' per_layer_config), at a tenth of the layers
GEMMA4 = {
    "architectures": ["Gemma4ForConditionalGeneration"], "eos_token_id": [1, 106], "dtype": "bfloat16",
    "text_config": {
        "model_type": "gemma4_text", "vocab_size": 262144, "hidden_size": 1536, "intermediate_size": 6144,
        "num_hidden_layers": 10, "num_attention_heads": 8, "num_key_value_heads": 1, "head_dim": 256,
        "global_head_dim": 512, "num_kv_shared_layers": 4, "use_double_wide_mlp": True, "sliding_window": 512,
        "hidden_size_per_layer_input": 256, "vocab_size_per_layer_input": 262144, "final_logit_softcapping": 30.0,
        "hidden_activation": "gelu_pytorch_tanh", "max_position_embeddings": 131072,
        "layer_types": ["sliding_attention"] * 4 + ["full_attention"] + ["sliding_attention"] * 4 + ["full_attention"],
        "rope_parameters": {
            "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1e6},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}},
    "vision_config": {"model_type": "gemma4_vision"}, "audio_config": {"model_type": "gemma4_audio"}}


def test_gemma4_per_layer_shapes_shared_kv_and_per_layer_inputs():
    config = parse_model_config(GEMMA4)
    assert config.architecture == "Gemma4ForCausalLM" and config.tie_word_embeddings
    assert config.layer_head_dims == [256] * 4 + [512] + [256] * 4 + [512]
    assert config.layer_kv_heads == [1] * 10 and config.layer_values_are_keys == [False] * 10
    # layers 6-9 attend over the K/V of the last earlier layer of their type: 5 (sliding) and 4 (global)
    assert config.layer_kv_source == [0, 1, 2, 3, 4, 5, 5, 5, 5, 4]
    assert config.attention_layers == [0, 1, 2, 3, 4, 5]
    assert config.layer_intermediate_sizes == [6144] * 6 + [12288] * 4
    assert config.layer_windows == ([512] * 4 + [None]) * 2
    assert (config.per_layer_input_size, config.per_layer_vocab_size) == (256, 262144)
    assert (config.attention_scale, config.embedding_multiplier, config.norm_weight_offset) == (1.0, 1536**0.5, 0.0)
    assert config.value_norm and config.layer_scalars and config.final_logit_softcap == 30.0
    assert (config.rope_theta, config.local_rope_theta) == (1e6, 1e4)
    assert config.rope_scaling == {"rope_type": "proportional", "fraction": 0.25, "factor": 1.0}
    assert not config.uniform_attention


def test_gemma4_values_that_are_keys_take_the_global_kv_head_count():
    text = {**GEMMA4["text_config"], "attention_k_eq_v": True, "num_global_key_value_heads": 4,
            "num_key_value_heads": 8, "num_kv_shared_layers": 0}
    config = parse_model_config({**GEMMA4, "text_config": text})
    assert config.layer_kv_heads == ([8] * 4 + [4]) * 2
    assert config.layer_values_are_keys == ([False] * 4 + [True]) * 2
    assert config.layer_kv_source == list(range(10)) and config.layer_intermediate_sizes == [6144] * 10


def test_gemma4_proportional_rope_turns_the_head_pairs_transformers_turns():
    from transformers import Gemma4TextConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from tailrace.model.decoder.llama import rope_inverse_frequencies

    theirs, _ = ROPE_INIT_FUNCTIONS["proportional"](Gemma4TextConfig(global_head_dim=512), layer_type="full_attention")
    ours = rope_inverse_frequencies(parse_model_config(GEMMA4), "global")
    assert ours.shape == (256,) and (ours[64:] == 0).all()
    assert torch.equal(ours, theirs)


def test_gemma4s_experts_run_beside_every_layers_mlp_with_float32_weights():
    text = {**GEMMA4["text_config"], "enable_moe_block": True, "num_experts": 128, "top_k_experts": 8,
            "moe_intermediate_size": 704, "hidden_size_per_layer_input": 0}
    config = parse_model_config({**GEMMA4, "text_config": text})
    assert config.experts_beside_mlp and config.layer_moe == [True] * 10
    assert (config.num_experts, config.experts_per_token, config.moe_intermediate_size) == (128, 8, 704)
    assert config.norm_topk_prob and config.router_float32 and config.per_layer_input_size == 0
    dense = parse_model_config({**GEMMA4, "text_config": {**text, "enable_moe_block": False}})
    assert not dense.experts_beside_mlp and dense.layer_moe == [False] * 10


def test_bidirectional_attention_for_vision_tokens_leaves_text_causal():
    assert parse_model_config({**GEMMA4, "text_config": {**GEMMA4["text_config"],
                                                         "use_bidirectional_attention": "vision"}}).causal
    assert not parse_model_config({**GEMMA4, "text_config": {**GEMMA4["text_config"],
                                                             "use_bidirectional_attention": "all"}}).causal


def test_layer_types_of_the_wrong_length_are_refused():
    with pytest.raises(ValueError, match="layer_types"):
        parse("gemma3", layer_types=["sliding_attention"])


def test_a_layer_type_the_architecture_does_not_serve_is_named():
    with pytest.raises(ValueError, match="unsupported layer type 'mamba' in layer_types; Qwen3_5ForCausalLM serves "
                                         "full_attention, linear_attention, sliding_attention"):
        parse_model_config({**tiny("llama"), "architectures": ["Qwen3_5ForCausalLM"], "num_hidden_layers": 2,
                            "layer_types": ["linear_attention", "mamba"]})


def test_single_eos_id_becomes_a_list():
    assert parse(eos_token_id=2).eos_token_ids == [2]


def test_dtype_is_read_from_either_key():
    assert parse(dtype="bfloat16").torch_dtype == "bfloat16"
    assert parse(torch_dtype="float16").torch_dtype == "float16"


def test_an_unknown_activation_is_rejected_naming_the_supported():
    with pytest.raises(ValueError, match="'gelu'.*gelu_pytorch_tanh"):
        parse(hidden_act="gelu")


def test_generation_config_adds_stop_tokens(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({**BASE, "eos_token_id": 2}))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7]}))
    assert load_model_config(str(tmp_path)).eos_token_ids == [2, 7]


@pytest.mark.parametrize("name,model_type,offset,types", [("BertModel", "bert", 0, 2),
                                                          ("XLMRobertaModel", "xlm-roberta", 2, 1)])
def test_an_encoders_config_is_bidirectional_post_norm_with_learned_positions(name, model_type, offset, types):
    config = parse_model_config({
        "architectures": [name], "model_type": model_type, "vocab_size": 100, "hidden_size": 64,
        "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "hidden_act": "gelu",
        "max_position_embeddings": 512 + offset, "type_vocab_size": types, "layer_norm_eps": 1e-12,
        "pad_token_id": 1, "position_embedding_type": "absolute"})
    assert not config.causal and config.layer_norm and config.rms_norm_eps == 1e-12
    assert config.max_position_embeddings == 512 and config.position_offset == offset
    assert config.type_vocab_size == types and config.absolute_positions and config.embedding_norm
    assert config.layer_rope == [None, None] and config.norm_style == "post_residual"
    assert config.hidden_act == "gelu" and not config.mlp_gated and config.mlp_bias
    assert config.attention_bias and config.attention_out_bias and config.num_labels == 0


def test_a_classifiers_labels_and_unsupported_positions():
    raw = {"architectures": ["BertForSequenceClassification"], "model_type": "bert", "vocab_size": 100,
           "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
           "hidden_act": "gelu", "max_position_embeddings": 512, "id2label": {"0": "LABEL_0"}}
    assert parse_model_config(raw).num_labels == 1
    with pytest.raises(ValueError, match="unsupported position_embedding_type 'relative_key'"):
        parse_model_config({**raw, "position_embedding_type": "relative_key"})


def test_modernberts_released_config_names_its_layers_windows_and_rotary_bases():
    config = parse_model_config({
        "architectures": ["ModernBertModel"], "model_type": "modernbert", "vocab_size": 100, "hidden_size": 64,
        "intermediate_size": 128, "num_hidden_layers": 6, "num_attention_heads": 4, "hidden_activation": "gelu",
        "max_position_embeddings": 8192, "norm_eps": 1e-5, "norm_bias": False, "local_attention": 128,
        "global_attn_every_n_layers": 3, "global_rope_theta": 160000.0, "local_rope_theta": 10000.0})
    assert config.layer_windows == [None, 65, 65, None, 65, 65]  # keys at most 64 positions away, either side
    assert config.layer_rope == ["global", "local", "local", "global", "local", "local"]
    assert (config.rope_theta, config.local_rope_theta) == (160000.0, 10000.0)
    assert not config.causal and config.layer_norm and not config.norm_bias and config.norm_style == "pre"
    assert config.hidden_act == "gelu" and config.mlp_gated and not config.first_layer_input_norm
