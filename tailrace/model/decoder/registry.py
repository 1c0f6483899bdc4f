"""Every architecture tailrace serves, one entry each: its names (Hugging Face's, GGUF's), the
features of the one decoder it uses (ModelConfig's, from config.py) and its checkpoints' quirks.

An entry is plain data; config.py, gguf.py, loader.py and tp_shard.py read it, and no module
compares architecture names. What an entry leaves at its default is Llama's.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

# GGUF layer tensor names (after `blk.N.`) -> Hugging Face's (after `model.layers.N.`), as
# llama.cpp's converter writes Llama.
LLAMA_GGUF_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    # a mixture of experts' router, and its experts stacked [experts, out, in]
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.gate_exps",
    "ffn_up_exps": "mlp.up_exps",
    "ffn_down_exps": "mlp.down_exps",
}
# Gemma's sandwich norms: ffn_norm is the MLP's input norm, which Gemma calls pre_feedforward.
_GEMMA_GGUF_LAYER_NAMES = {
    **LLAMA_GGUF_LAYER_NAMES,
    "ffn_norm": "pre_feedforward_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
# OLMo 2 norms the blocks' outputs alone.
_OLMO2_GGUF_LAYER_NAMES = {**LLAMA_GGUF_LAYER_NAMES, "post_attention_norm": "post_attention_layernorm",
                           "post_ffw_norm": "post_feedforward_layernorm"}
# gpt-oss: post_attention_norm is the MLP's input norm, as Llama names it; a sink logit per head.
_GPT_OSS_GGUF_LAYER_NAMES = {**LLAMA_GGUF_LAYER_NAMES, "post_attention_norm": "post_attention_layernorm",
                             "attn_sinks": "self_attn.sinks"}
# Phi-3 keeps q/k/v in one tensor, and gate and up in ffn_up.
_PHI3_GGUF_LAYER_NAMES = {**LLAMA_GGUF_LAYER_NAMES, "attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"}

# BERT's layers as llama.cpp's converter names them: LayerNorms after the attention's and the
# MLP's residual adds, and a plain MLP (up, then down)
_BERT_GGUF_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_output_norm": "post_attention_layernorm",
    "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj", "layer_output_norm": "post_feedforward_layernorm",
}

# NomicBERT's: q/k/v fused, a SwiGLU MLP
_NOMIC_GGUF_LAYER_NAMES = {
    "attn_qkv": "self_attn.qkv_proj", "attn_output": "self_attn.o_proj", "attn_output_norm": "post_attention_layernorm",
    "ffn_up": "mlp.up_proj", "ffn_gate": "mlp.gate_proj", "ffn_down": "mlp.down_proj",
    "layer_output_norm": "post_feedforward_layernorm",
}

# Qwen3-Next's and Qwen3.5's: the MLP's input norm as post_attention_norm, Gated DeltaNet's
# tensors (ssm_a holds -exp(A_log), ssm_dt.bias dt_bias; Qwen3-Next's ssm_ba its in_proj_ba as
# stored), and the shared expert's. A name with its kind (ssm_dt.bias) or without one (ssm_a)
# is the whole tensor's.
_QWEN3_NEXT_GGUF_LAYER_NAMES = {
    **LLAMA_GGUF_LAYER_NAMES, "post_attention_norm": "post_attention_layernorm",
    "attn_qkv": "linear_attn.in_proj_qkv", "attn_gate": "linear_attn.in_proj_z", "ssm_beta": "linear_attn.in_proj_b",
    "ssm_alpha": "linear_attn.in_proj_a", "ssm_ba": "linear_attn.in_proj_ba", "ssm_conv1d": "linear_attn.conv1d",
    "ssm_a": "linear_attn.A", "ssm_dt.bias": "linear_attn.dt_bias", "ssm_norm": "linear_attn.norm",
    "ssm_out": "linear_attn.out_proj", "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj", "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
}

# Gemma 4's: Gemma's sandwich norms; per-layer inputs (the model-wide per_layer_token_embd,
# per_layer_model_proj and per_layer_proj_norm by their own names) and each layer's scalar.
_GEMMA4_GGUF_LAYER_NAMES = {
    **_GEMMA_GGUF_LAYER_NAMES, "inp_gate": "per_layer_input_gate", "proj": "per_layer_projection",
    "post_norm": "post_per_layer_input_norm", "layer_output_scale.weight": "layer_scalar",
    # the 26B-A4B's experts beside the MLP, their router's input scale and each expert's scale
    "ffn_gate_inp": "moe.gate", "ffn_gate_inp.scale": "moe.router_scale", "ffn_down_exps.scale": "moe.expert_scale",
    "ffn_gate_exps": "moe.gate_exps", "ffn_up_exps": "moe.up_exps", "ffn_gate_up_exps": "moe.gate_up_exps",
    "ffn_down_exps": "moe.down_exps", "pre_ffw_norm_2": "pre_feedforward_layernorm_2",
    "post_ffw_norm_1": "post_feedforward_layernorm_1", "post_ffw_norm_2": "post_feedforward_layernorm_2",
}

# Gemma 3's text model as its multimodal checkpoints (4B, 12B, 27B) leave it: their config.json's
# text_config names only what differs from Gemma3TextConfig's defaults, which these are.
_GEMMA3_TEXT_DEFAULTS = {
    "vocab_size": 262208, "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256,
    "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-6, "rope_theta": 1_000_000.0, "rope_local_base_freq": 10_000.0,
    "sliding_window_pattern": 6, "sliding_window": 4096, "max_position_embeddings": 131072,
    "hidden_activation": "gelu_pytorch_tanh", "tie_word_embeddings": True,
}


@dataclass(frozen=True, slots=True)
class Architecture:
    name: str  # Hugging Face's class name: config.json's `architectures`, ModelConfig.architecture
    model_types: tuple[str, ...]  # config.json's model_type, for configs that name no class
    # An image-text class whose text model this is (the image tower is not read), and the text
    # config's defaults its config.json leaves out.
    image_text_name: str = ""
    image_text_defaults: Mapping[str, Any] = field(default_factory=dict)
    # Its base model's class (no language-model head), as embedding models ship it (Qwen3-Embedding)
    base_name: str = ""
    # Its sequence classifier's class (a score head on one token's hidden state: cross-encoders)
    classifier_name: str = ""
    # An encoder's family (config.py's _encoder_features), "" for a decoder. Each attends both
    # ways and pools or classifies, never generates. "bert": post-residual LayerNorms, learned
    # absolute positions and token types, a plain GELU MLP, biases throughout; "nomic": BERT's
    # norms and token types with rotary positions, a SwiGLU MLP, no biases; "modernbert":
    # pre-norm LayerNorms without biases (the first layer's attention reads its input unnormed),
    # a GeGLU MLP, global and sliding layers with their own rotary bases.
    encoder: str = ""

    # ModelConfig's features
    qkv_bias_always: bool = False  # q/k/v have biases that no config flag names (Qwen2)
    # config.json's attention_bias gives o_proj a bias as well as q/k/v, as in transformers
    bias_flag_covers_out: bool = False
    out_bias_always: bool = False  # o_proj always has a bias (gpt-oss)
    qk_norm: bool = False
    qk_norm_over_heads: bool = False  # q and k each normed over all its heads at once (OLMo 2)
    norm_style: str = "pre"  # ModelConfig.norm_style
    # Gemma's: norms scale by 1 + weight, embedding rows by sqrt(hidden), the attention by
    # query_pre_attn_scalar, soft caps from the config, the embeddings tied unless it says otherwise.
    gemma_scaling: bool = False
    # Gemma 4's: plain norm weights, embedding rows by sqrt(hidden), attention at scale 1 over
    # RMS-normed V, layer scalars, and (config.py's _gemma4_layers) per-layer shapes, shared K/V
    # and per-layer inputs; the embeddings tied unless the config says otherwise.
    gemma4: bool = False
    multipliers: bool = False  # Granite's embedding, residual, attention and logit multipliers
    attention_sinks: bool = False  # a learned logit per head in each softmax (gpt-oss)
    # "": dense; "qwen3_moe", "qwen3_next", "mixtral", "gpt_oss" or "gemma4": how config.py reads its experts
    moe: str = ""
    # Its layer_types' "linear_attention" layers are Gated DeltaNet, and its attention layers gate
    # their output (Qwen3-Next, Qwen3.5)
    gated_delta: bool = False
    zero_centered_norms: bool = False  # its RMSNorms scale by 1 + weight (not Gemma's other scalings)
    # Sliding-window layers where the config names no layer_types: 0, all or none as the config
    # has a sliding_window; n, layer i slides unless i % n == n - 1, n the config's
    # sliding_window_pattern where it names one (Gemma 3's do).
    sliding_period: int = 0
    # The config's sliding_window applies only with use_sliding_window: Qwen's configs carry a
    # window regardless (SmolLM3's copy it).
    window_needs_flag: bool = False
    nope_interval: int = 0  # every n-th layer has no rotary positions (SmolLM3's NoPE); 0: none

    # Checkpoints
    stored_fused: bool = False  # q/k/v and gate/up stored fused (Phi-3), so tp_shard cannot split them
    # Experts stacked with gate and up interleaved, as MXFP4 blocks or floats (loader.gpt_oss_tensors).
    mxfp4_experts: bool = False

    # GGUF: general.architecture, and what the metadata leaves to llama.cpp's fixed rules (gguf.py)
    gguf_arch: str = ""  # "": tailrace reads no GGUF file of it
    # The GGUF name of its base model attending both ways, which embeds (Gemma 3's: EmbeddingGemma)
    gguf_embedding_arch: str = ""
    gguf_permuted: bool = False  # llama.cpp's converter interleaved the rotary halves of q and k rows
    gguf_layer_names: Mapping[str, str] = field(default_factory=lambda: LLAMA_GGUF_LAYER_NAMES)
    gguf_attention_bias: bool = False  # q/k/v have biases (gpt-oss)
    gguf_partial_rotary: bool = False  # rope.dimension_count is the dims of a head that rotate (Phi-3)
    gguf_default_window: int = 0  # Gemma's sliding window where the file names none; 0: no window
    gguf_largest_layers: int = 0  # Gemma's largest model's layer count: its query scale is hidden / heads
    gguf_attention_softcap: bool = False  # attn_logit_softcapping in the metadata (Gemma 2)
    gguf_local_rope: bool = False  # rope.freq_base_swa: the sliding layers' rope base (Gemma 3)
    gguf_yarn_truncate: bool = True  # False: its released config's YaRN does not truncate (gpt-oss)
    # llama.cpp's converter tiles the value heads (h reads q/k head h % key_heads; Qwen3.5's)
    gguf_tiled_value_heads: bool = False


ARCHITECTURES = (
    Architecture("LlamaForCausalLM", ("llama",), base_name="LlamaModel", bias_flag_covers_out=True, gguf_arch="llama",
                 gguf_permuted=True),
    Architecture("MistralForCausalLM", ("mistral",), base_name="MistralModel"),
    Architecture("Qwen2ForCausalLM", ("qwen2",), base_name="Qwen2Model", qkv_bias_always=True, window_needs_flag=True,
                 gguf_arch="qwen2"),
    Architecture("Qwen3ForCausalLM", ("qwen3",), base_name="Qwen3Model", bias_flag_covers_out=True, qk_norm=True,
                 window_needs_flag=True, gguf_arch="qwen3"),
    Architecture("SmolLM3ForCausalLM", ("smollm3",), bias_flag_covers_out=True, window_needs_flag=True,
                 nope_interval=4, gguf_arch="smollm3", gguf_permuted=True),
    Architecture("Gemma2ForCausalLM", ("gemma2",), bias_flag_covers_out=True, norm_style="sandwich",
                 gemma_scaling=True, sliding_period=2, gguf_arch="gemma2", gguf_layer_names=_GEMMA_GGUF_LAYER_NAMES,
                 gguf_default_window=4096, gguf_largest_layers=46, gguf_attention_softcap=True),
    Architecture("Gemma3ForCausalLM", ("gemma3_text",), image_text_name="Gemma3ForConditionalGeneration",
                 base_name="Gemma3TextModel",
                 image_text_defaults=_GEMMA3_TEXT_DEFAULTS, bias_flag_covers_out=True, qk_norm=True,
                 norm_style="sandwich", gemma_scaling=True, sliding_period=6, gguf_arch="gemma3",
                 gguf_embedding_arch="gemma-embedding", gguf_layer_names=_GEMMA_GGUF_LAYER_NAMES,
                 gguf_largest_layers=62, gguf_local_rope=True),
    Architecture("Gemma4ForCausalLM", ("gemma4_text",), image_text_name="Gemma4ForConditionalGeneration",
                 base_name="Gemma4TextModel", bias_flag_covers_out=True, qk_norm=True, norm_style="sandwich",
                 gemma4=True, moe="gemma4", sliding_period=6, gguf_arch="gemma4",
                 gguf_layer_names=_GEMMA4_GGUF_LAYER_NAMES),
    Architecture("Phi3ForCausalLM", ("phi3",), stored_fused=True, gguf_arch="phi3",
                 gguf_layer_names=_PHI3_GGUF_LAYER_NAMES, gguf_partial_rotary=True),
    Architecture("Qwen3MoeForCausalLM", ("qwen3_moe",), bias_flag_covers_out=True, qk_norm=True, moe="qwen3_moe",
                 window_needs_flag=True, gguf_arch="qwen3moe"),
    # llama.cpp's converter writes Mixtral as llama with experts
    Architecture("MixtralForCausalLM", ("mixtral",), moe="mixtral", gguf_arch="llama", gguf_permuted=True),
    Architecture("GptOssForCausalLM", ("gpt_oss",), out_bias_always=True, attention_sinks=True, moe="gpt_oss",
                 sliding_period=2, mxfp4_experts=True, gguf_arch="gpt-oss", gguf_layer_names=_GPT_OSS_GGUF_LAYER_NAMES,
                 gguf_attention_bias=True, gguf_yarn_truncate=False),
    Architecture("GraniteForCausalLM", ("granite",), bias_flag_covers_out=True, multipliers=True, gguf_arch="granite",
                 gguf_permuted=True),
    Architecture("BertModel", ("bert",), classifier_name="BertForSequenceClassification", encoder="bert",
                 gguf_arch="bert", gguf_layer_names=_BERT_GGUF_LAYER_NAMES),
    Architecture("XLMRobertaModel", ("xlm-roberta",), classifier_name="XLMRobertaForSequenceClassification",
                 encoder="bert"),
    Architecture("RobertaModel", ("roberta",), classifier_name="RobertaForSequenceClassification", encoder="bert"),
    Architecture("NomicBertModel", ("nomic_bert",), encoder="nomic", gguf_arch="nomic-bert",
                 gguf_layer_names=_NOMIC_GGUF_LAYER_NAMES),
    Architecture("ModernBertModel", ("modernbert",), encoder="modernbert"),
    Architecture("Qwen3_5ForCausalLM", ("qwen3_5_text",), image_text_name="Qwen3_5ForConditionalGeneration",
                 bias_flag_covers_out=True, qk_norm=True, gated_delta=True, zero_centered_norms=True, gguf_arch="qwen35",
                 gguf_layer_names=_QWEN3_NEXT_GGUF_LAYER_NAMES, gguf_tiled_value_heads=True),
    Architecture("Qwen3_5MoeForCausalLM", ("qwen3_5_moe_text",), image_text_name="Qwen3_5MoeForConditionalGeneration",
                 bias_flag_covers_out=True, qk_norm=True, gated_delta=True, zero_centered_norms=True, moe="qwen3_next",
                 gguf_arch="qwen35moe", gguf_layer_names=_QWEN3_NEXT_GGUF_LAYER_NAMES, gguf_tiled_value_heads=True),
    Architecture("Qwen3NextForCausalLM", ("qwen3_next",), bias_flag_covers_out=True, qk_norm=True, gated_delta=True,
                 zero_centered_norms=True, moe="qwen3_next", gguf_arch="qwen3next",
                 gguf_layer_names=_QWEN3_NEXT_GGUF_LAYER_NAMES),
    Architecture("Olmo2ForCausalLM", ("olmo2",), bias_flag_covers_out=True, qk_norm=True, qk_norm_over_heads=True,
                 norm_style="post", gguf_arch="olmo2", gguf_layer_names=_OLMO2_GGUF_LAYER_NAMES),
)

_BY_NAME = {entry.name: entry for entry in ARCHITECTURES}
_BY_IMAGE_TEXT_NAME = {entry.image_text_name: entry for entry in ARCHITECTURES if entry.image_text_name}
_BY_BASE_NAME = {entry.base_name: entry for entry in ARCHITECTURES if entry.base_name}
_BY_CLASSIFIER_NAME = {entry.classifier_name: entry for entry in ARCHITECTURES if entry.classifier_name}
_BY_MODEL_TYPE = {model_type: entry for entry in ARCHITECTURES for model_type in entry.model_types}
# The first entry of each GGUF name is the one its dense files are (llama: Llama, not Mixtral); an
# embedding model's GGUF name is its entry's.
GGUF_ARCHITECTURES = {**{arch: next(e for e in ARCHITECTURES if e.gguf_arch == arch)
                         for arch in dict.fromkeys(e.gguf_arch for e in ARCHITECTURES if e.gguf_arch)},
                      **{e.gguf_embedding_arch: e for e in ARCHITECTURES if e.gguf_embedding_arch}}
# Every class name config.json may give: the text models', the image-text ones', the base models'
# and the classifiers'.
SUPPORTED_NAMES = (frozenset(_BY_NAME) | frozenset(_BY_IMAGE_TEXT_NAME) | frozenset(_BY_BASE_NAME)
                   | frozenset(_BY_CLASSIFIER_NAME))


def architecture(name: str) -> Architecture:
    """The entry of a text model's (or its base model's, or its classifier's) Hugging Face class
    name; KeyError for any other."""
    for table in (_BY_NAME, _BY_BASE_NAME, _BY_CLASSIFIER_NAME):
        if name in table:
            return table[name]
    raise KeyError(name)


def is_base_model(name: str) -> bool:
    """Whether `name` is a base model's class: hidden states out, no language-model head (an
    encoder's own class is one)."""
    return name in _BY_BASE_NAME or (name in _BY_NAME and _BY_NAME[name].encoder)


def is_classifier(name: str) -> bool:
    """Whether `name` is a sequence classifier's class (a cross-encoder's)."""
    return name in _BY_CLASSIFIER_NAME


def by_model_type(model_type: str) -> Architecture | None:
    return _BY_MODEL_TYPE.get(model_type)


def image_text(name: str) -> Architecture | None:
    """The entry whose image-text class `name` is, None for any other name."""
    return _BY_IMAGE_TEXT_NAME.get(name)


def gguf_embeds(arch: str) -> bool:
    """Whether a GGUF file of general.architecture `arch` is an embedding model: an encoder's, or
    a decoder's base model attending both ways (EmbeddingGemma's gemma-embedding)."""
    entry = GGUF_ARCHITECTURES[arch]
    return bool(entry.encoder) or arch == entry.gguf_embedding_arch


def gguf_architecture(arch: str, experts: bool = False) -> Architecture:
    """The entry a GGUF file of general.architecture `arch` is: with `experts`, the one among its
    entries that has them, if any."""
    entries = [e for e in ARCHITECTURES if arch in (e.gguf_arch, e.gguf_embedding_arch)]
    if not entries:
        raise KeyError(arch)
    return next((e for e in entries if bool(e.moe) == experts), entries[0])
