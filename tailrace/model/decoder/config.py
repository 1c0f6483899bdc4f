"""The model's shape and conventions, parsed from a Hugging Face `config.json` dict (or a GGUF file's
metadata as loading/gguf.py turns it into one); loading/loader.load_model_config reads the files."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from tailrace.model.decoder import registry

# Every architecture is one entry of model/decoder/registry.py, read here as the features of one decoder
# (llama.py runs them in Python, csrc/decoder.cpp in one call).
SUPPORTED_ARCHITECTURES = registry.SUPPORTED_NAMES
_ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh"}  # a gated MLP's
# an encoder's plain MLP: GELU by erf, or by tanh
_ENCODER_ACTIVATIONS = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh"}
_MODERNBERT_ACTIVATIONS = {**_ACTIVATIONS, "gelu": "gelu"}  # its gated MLP's: GELU by erf (GeGLU)

SUPPORTED_ROPE_TYPES = {"llama3", "linear", "longrope", "proportional", "yarn"}
# Not a config.json's: each frequency divided by its stored factor, for a GGUF's rope_freqs that
# no Llama 3 scaling gives (loading/gguf.py).
_GGUF_ROPE_TYPES = {"freq_factors"}


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
    # Per layer: the positions a query sees back from itself (sliding-window layers), None for all.
    layer_windows: list[int | None] = field(default_factory=list)
    # Per layer: which rotary table rotates its q/k ("global": rope_theta with rope_scaling,
    # "local": local_rope_theta unscaled), None for a layer without positions (SmolLM3's NoPE layers).
    layer_rope: list[str | None] = field(default_factory=list)
    local_rope_theta: float | None = None
    rotary_dim: int = 0  # the leading dims of each head that rotate (Phi-3's partial rotary); 0: all
    hidden_act: str = "silu"  # or "gelu_tanh"
    norm_weight_offset: float = 0.0  # a checkpoint's norm weights + this are the scales (Gemma: 1)
    embedding_multiplier: float = 1.0  # the embedding rows times this, rounded to the dtype first
    # "pre": the blocks' inputs normed; "sandwich" (Gemma): inputs and outputs; "post" (OLMo 2):
    # outputs (layer_plan.py makes each layer's steps of it)
    norm_style: str = "pre"
    qk_norm_over_heads: bool = False  # q and k normed each over all its heads (OLMo 2), not head by head
    residual_multiplier: float = 1.0  # each block's output times this joins the residual (Granite)
    logit_divisor: float = 1.0  # the logits divided by this (Granite's logits_scaling)
    attention_scale: float = 0.0  # q.k times this; 0: head_dim ** -0.5
    attention_softcap: float | None = None  # scores through cap * tanh(score / cap)
    attention_sinks: bool = False  # a learned logit per head joins each softmax, then is dropped (gpt-oss)
    attention_out_bias: bool = False  # o_proj has a bias
    final_logit_softcap: float | None = None  # logits likewise
    # Mixture of experts: per layer, whether its MLP is num_experts experts of moe_intermediate_size,
    # each token through the experts_per_token its router ranks first (their weights renormalised
    # to sum 1 with norm_topk_prob; kept in float32 with router_float32, as Mixtral's reference does).
    layer_moe: list[bool] = field(default_factory=list)
    num_experts: int = 0
    experts_per_token: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    router_float32: bool = False
    # gpt-oss: the router has a bias and softmaxes its top k logits (in the dtype); the experts have
    # biases and gate as swiglu_oai (hidden_act) with swiglu_alpha and swiglu_limit.
    moe_bias: bool = False
    router_topk_first: bool = False
    swiglu_alpha: float = 0.0
    swiglu_limit: float = 0.0
    # False: every token attends every token of its sequence (within its layer's window on either
    # side), so a prompt runs whole, in one step, and no K/V is kept: encoders (BERT and its kin)
    # and bidirectional decoders (EmbeddingGemma's)
    causal: bool = True
    layer_norm: bool = False  # norms are LayerNorms (eps: rms_norm_eps), not RMSNorms
    norm_bias: bool = True  # a LayerNorm's shift (ModernBERT's have none)
    first_layer_input_norm: bool = True  # False: the first layer's attention reads h unnormed (ModernBERT)
    absolute_positions: bool = False  # a learned table of positions (embed_positions), added to the embedding
    position_offset: int = 0  # the table's row of position 0 (RoBERTa's and XLM-R's padding_idx + 1)
    type_vocab_size: int = 0  # rows of the token-type table (embed_types: a pair's second text is type 1); 0: none
    embedding_norm: bool = False  # the summed embeddings normed (embed_norm)
    mlp_gated: bool = True  # False: down(act(up(x))), one projection in (BERT)
    mlp_bias: bool = False
    # A sequence classifier's outputs (a cross-encoder's: score.out_proj(tanh(score.dense(h))) of
    # its first token's hidden state h); 0: no classifier
    num_labels: int = 0
    # Per layer, how it mixes positions: "attention" (softmax attention over the KV cache), or
    # "gated_delta" (Gated DeltaNet, a linear attention that keeps a fixed-size state per
    # sequence: Qwen3.5's and Qwen3-Next's three of every four layers). Its shape: q/k heads and
    # their dims, v heads (a multiple of the q/k heads) and theirs, the causal convolution's width.
    layer_mixers: list[str] = field(default_factory=list)
    linear_key_heads: int = 0
    linear_key_dim: int = 0
    linear_value_heads: int = 0
    linear_value_dim: int = 0
    linear_conv_kernel: int = 0
    # Which q/k head a value head reads: grouped (Hugging Face's order: value head h reads q/k head
    # h // (value_heads / key_heads)) or tiled (llama.cpp's converter reorders Qwen3.5's value
    # heads so: h reads h % key_heads), whichever order the file holds its value heads in
    value_heads_tiled: bool = False
    # q_proj also gives each head a gate: the attention's output times sigmoid(gate) goes to
    # o_proj (Qwen3-Next's and Qwen3.5's attention layers)
    attention_output_gate: bool = False
    # A mixture of experts' shared expert (an MLP of this width every token takes, times
    # sigmoid(shared_expert_gate(x))); 0: none
    shared_expert_intermediate_size: int = 0
    # Per layer, where layers differ (empty: every layer the model's): its attention's shape (Gemma
    # 4's full-attention layers have wider heads, and with attention_k_eq_v their own KV head
    # count): its KV heads and head dim; an MLP's width (Gemma 4's KV-sharing layers may have
    # double-wide MLPs). Read through attention_shape and intermediate_size_of.
    layer_kv_heads: list[int] = field(default_factory=list)
    layer_head_dims: list[int] = field(default_factory=list)
    layer_intermediate_sizes: list[int] = field(default_factory=list)
    # Per layer (empty: each its own), the layer whose K/V it attends over: itself, or (Gemma 4's
    # last num_kv_shared_layers) the last earlier layer of its type that stores its own; a layer
    # reading another's projects only q and stores nothing. Read through kv_source.
    layer_kv_source: list[int] = field(default_factory=list)
    # Per layer (empty: none): its values are its keys' projection, before the k norm (Gemma 4's
    # attention_k_eq_v full-attention layers have no v_proj). Read through values_are_keys.
    layer_values_are_keys: list[bool] = field(default_factory=list)
    value_norm: bool = False  # V RMS-normed without a scale before it is stored (Gemma 4)
    # Gemma 4's per-layer inputs: a second embedding table of per_layer_vocab_size rows, each
    # layer's per_layer_input_size columns of it mixed with a projection of the embedding, which
    # each layer gates into its residual stream after its MLP; 0: none
    per_layer_input_size: int = 0
    per_layer_vocab_size: int = 0
    layer_scalars: bool = False  # each layer's output h times its checkpoint's layer_scalar (Gemma 4)
    # Gemma 4's (26B-A4B): a layer's experts run beside its dense MLP, each on h through its own
    # norms, their outputs summed; the router reads h RMS-normed times a learned scale and
    # hidden ** -0.5, and each expert's weight is times its learned scale
    experts_beside_mlp: bool = False

    def __post_init__(self) -> None:
        layers = self.num_hidden_layers
        self.layer_mixers = self.layer_mixers or ["attention"] * layers
        self.layer_windows = self.layer_windows or [None] * layers
        self.layer_rope = self.layer_rope or ["global"] * layers
        self.layer_moe = self.layer_moe or [False] * layers
        self.attention_scale = self.attention_scale or self.head_dim**-0.5
        self.rotary_dim = self.rotary_dim or self.head_dim

    @property
    def attention_layers(self) -> list[int]:
        """The layers that store K/V, in order: the i-th keeps its K/V in the cache's layer i (a
        layer reading another's K/V attends over that layer's)."""
        return [i for i, mixer in enumerate(self.layer_mixers) if mixer == "attention" and self.kv_source(i) == i]

    @property
    def first_kv_reader(self) -> int | None:
        """The first layer from which every layer reads another's K/V (Gemma 4's last
        num_kv_shared_layers), None where the last layer stores its own: past it, a row whose
        output is not wanted changes nothing."""
        readers = [i for i in range(self.num_hidden_layers) if self.kv_source(i) != i]
        if not readers or readers[-1] != self.num_hidden_layers - 1 or len(readers) != readers[-1] - readers[0] + 1:
            return None
        return readers[0]

    def attention_shape(self, layer: int) -> tuple[int, int]:
        """Layer `layer`'s KV heads and head dim."""
        return (self.layer_kv_heads[layer] if self.layer_kv_heads else self.num_key_value_heads,
                self.layer_head_dims[layer] if self.layer_head_dims else self.head_dim)

    def intermediate_size_of(self, layer: int) -> int:
        """Layer `layer`'s MLP width."""
        return self.layer_intermediate_sizes[layer] if self.layer_intermediate_sizes else self.intermediate_size

    def kv_source(self, layer: int) -> int:
        """The layer whose K/V layer `layer` attends over."""
        return self.layer_kv_source[layer] if self.layer_kv_source else layer

    def values_are_keys(self, layer: int) -> bool:
        return bool(self.layer_values_are_keys) and self.layer_values_are_keys[layer]

    def projected_parts(self, layer: int) -> int:
        """How many of q, k and v layer `layer` projects: q alone where it reads another layer's
        K/V, q and k where its values are its keys, else all three."""
        return 1 if self.kv_source(layer) != layer else 2 if self.values_are_keys(layer) else 3

    @property
    def head_dims(self) -> list[int]:
        """Every layer's head dim."""
        return [self.attention_shape(i)[1] for i in range(self.num_hidden_layers)]

    @property
    def uniform_attention(self) -> bool:
        """Whether every layer's attention has the model's shape and keeps its own K/V: what the
        one-call forward and the slot slab take."""
        return not (self.layer_kv_heads or self.layer_head_dims or self.layer_kv_source or self.layer_values_are_keys)

    def rope_head_dim(self, kind: str) -> int:
        """The head dim of the layers rotary table `kind` turns (one per table)."""
        dims = {self.attention_shape(i)[1] for i, rope in enumerate(self.layer_rope) if rope == kind}
        if len(dims) > 1:
            raise ValueError(f"the layers of rotary table {kind!r} have head dims {sorted(dims)}")
        return dims.pop() if dims else self.head_dim

    @property
    def gated_delta_layers(self) -> list[int]:
        """The Gated DeltaNet layers, in order: the i-th keeps its state in the state cache's layer i."""
        return [i for i, mixer in enumerate(self.layer_mixers) if mixer == "gated_delta"]


def parse_model_config(raw: dict[str, Any]) -> ModelConfig:
    raw = _text_part(raw)
    entry = _architecture(raw)
    if entry.gated_delta:  # a quarter of each head rotates unless the config says otherwise
        raw = {"partial_rotary_factor": 0.25, **raw}
    if entry.encoder == "nomic":
        raw = _nomic_keys(raw)
    elif entry.encoder == "modernbert":
        raw = _modernbert_keys(raw)
    name = (raw.get("architectures") or [""])[0]
    headless = registry.is_base_model(name) or registry.is_classifier(name)
    act = raw.get("hidden_activation") or raw.get("hidden_act") or "silu"
    activations = {"bert": _ENCODER_ACTIVATIONS, "modernbert": _MODERNBERT_ACTIVATIONS}.get(entry.encoder, _ACTIVATIONS)
    if act not in activations:
        raise ValueError(f"unsupported activation {act!r}; supported: {', '.join(sorted(activations))}")
    encoder = _encoder_features(raw, name, entry) if entry.encoder else {}
    if encoder:
        raw = {**raw, "rms_norm_eps": raw.get("layer_norm_eps", raw.get("norm_eps", 1e-12)),
               "max_position_embeddings": raw["max_position_embeddings"] - encoder["position_offset"]}
    elif raw.get("mlp_bias", False):
        raise ValueError("unsupported mlp_bias=true")
    num_heads, layers = raw["num_attention_heads"], raw["num_hidden_layers"]
    head_dim = raw.get("head_dim") or raw["hidden_size"] // num_heads
    layer_types = _layer_types(raw, entry)
    max_positions = raw.get("max_position_embeddings", 2048)
    rope_theta, rope_scaling, local_theta, rotary_fraction = _rope(raw, max_positions)
    experts = _experts(raw, entry, layers)
    window = raw.get("sliding_window")
    # EmbeddingGemma's decoder ("all" in Gemma 4's; its "vision" is an image's own tokens, causal for text)
    bidirectional = raw.get("use_bidirectional_attention") in (True, "all")
    if window is not None and bidirectional:
        window = window // 2 + 1  # a query sees keys less than this far on either side, as transformers sets it
    if window is not None and window >= max_positions:  # it never bites
        window = None
    return ModelConfig(
        architecture=entry.name,
        vocab_size=raw["vocab_size"],
        hidden_size=raw["hidden_size"],
        intermediate_size=raw["intermediate_size"],
        num_hidden_layers=layers,
        num_attention_heads=num_heads,
        num_key_value_heads=raw.get("num_key_value_heads") or num_heads,
        head_dim=head_dim,
        rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        max_position_embeddings=max_positions,
        # A base model (Qwen3Model) has no head of its own: it serves pooling, which reads no logits.
        tie_word_embeddings=headless or raw.get("tie_word_embeddings", entry.gemma_scaling or entry.gemma4),
        attention_bias=entry.qkv_bias_always or entry.encoder == "bert" or raw.get("attention_bias", False),
        qk_norm=entry.qk_norm,
        torch_dtype=raw.get("dtype") or raw.get("torch_dtype") or "float32",
        bos_token_id=raw.get("bos_token_id"),
        eos_token_ids=as_id_list(raw.get("eos_token_id")),
        layer_windows=[window if kind == "sliding_attention" else None for kind in layer_types],
        layer_mixers=["gated_delta" if kind == "linear_attention" else "attention" for kind in layer_types],
        layer_rope=_layer_rope(raw, entry, layer_types, local_theta),
        local_rope_theta=local_theta,
        rotary_dim=_rotary_dim(head_dim, rotary_fraction),
        hidden_act=experts.pop("hidden_act", activations[act]),
        **(_family_features(raw, entry) | encoder | _linear_attention(raw, entry) | _gemma4_layers(raw, entry, layer_types)
           | ({"causal": False} if bidirectional else {})),
        **experts,
    )


def _text_part(raw: dict[str, Any]) -> dict[str, Any]:
    """A multimodal checkpoint's config as its text model's (Gemma 3's): the image tower is not
    read; the loader takes the language model's weights under their own names."""
    entry = registry.image_text((raw.get("architectures") or [""])[0])
    if entry is None:
        return raw
    text = {**entry.image_text_defaults, **raw.get("text_config", {}), "architectures": [entry.name]}
    for key in ("eos_token_id", "bos_token_id", "dtype", "torch_dtype"):
        if key in raw:
            text.setdefault(key, raw[key])
    return text


def _family_features(raw: dict[str, Any], entry: registry.Architecture) -> dict[str, Any]:
    """What a family changes in the layers and around them (defaults: Llama's)."""
    bias = raw.get("attention_bias", False)
    features = {"norm_style": entry.norm_style, "qk_norm_over_heads": entry.qk_norm_over_heads,
                "attention_sinks": entry.attention_sinks,
                "attention_out_bias": entry.out_bias_always or (entry.bias_flag_covers_out and bias)}
    if entry.gemma_scaling:
        features |= {"norm_weight_offset": 1.0, "embedding_multiplier": raw["hidden_size"] ** 0.5,
                     "attention_scale": raw["query_pre_attn_scalar"] ** -0.5,
                     "attention_softcap": raw.get("attn_logit_softcapping"),
                     "final_logit_softcap": raw.get("final_logit_softcapping")}
    if entry.gemma4:
        features |= {"embedding_multiplier": raw["hidden_size"] ** 0.5, "attention_scale": 1.0,
                     "final_logit_softcap": raw.get("final_logit_softcapping"), "value_norm": True,
                     "layer_scalars": True}
    if entry.zero_centered_norms:
        features["norm_weight_offset"] = 1.0
    if entry.multipliers:
        features |= {"embedding_multiplier": raw.get("embedding_multiplier", 1.0),
                     "residual_multiplier": raw.get("residual_multiplier", 1.0),
                     "attention_scale": raw.get("attention_multiplier", 0.0),
                     "logit_divisor": raw.get("logits_scaling", 1.0)}
    return features


def _linear_attention(raw: dict[str, Any], entry: registry.Architecture) -> dict[str, Any]:
    """A hybrid's Gated DeltaNet shape and its attention layers' output gate (Qwen3-Next, Qwen3.5)."""
    if not entry.gated_delta:
        return {}
    key_heads, value_heads = raw.get("linear_num_key_heads", 16), raw.get("linear_num_value_heads", 32)
    if value_heads % key_heads:
        raise ValueError(f"linear_num_value_heads {value_heads} must be a multiple of linear_num_key_heads {key_heads}")
    return {"linear_key_heads": key_heads, "linear_key_dim": raw.get("linear_key_head_dim", 128),
            "linear_value_heads": value_heads, "linear_value_dim": raw.get("linear_value_head_dim", 128),
            "linear_conv_kernel": raw.get("linear_conv_kernel_dim", 4), "attention_output_gate": True,
            "value_heads_tiled": raw.get("value_heads_tiled", False)}  # loading/gguf.py's key


def _gemma4_layers(raw: dict[str, Any], entry: registry.Architecture, layer_types: list[str]) -> dict[str, Any]:
    """Gemma 4's per-layer shapes, as transformers resolves them: full-attention layers with
    global_head_dim (512 where the config names none) and, with attention_k_eq_v, their values
    their keys and num_global_key_value_heads KV heads, or whatever per_layer_config says of a
    layer; the last num_kv_shared_layers layers attending over the K/V of the last earlier layer of
    their type, with double-wide MLPs where use_double_wide_mlp says; per-layer inputs where
    hidden_size_per_layer_input is set."""
    if not entry.gemma4:
        return {}
    layers, k_eq_v = raw["num_hidden_layers"], bool(raw.get("attention_k_eq_v"))
    head_dim, kv_heads = raw.get("head_dim") or raw["hidden_size"] // raw["num_attention_heads"], \
        raw.get("num_key_value_heads") or raw["num_attention_heads"]
    overrides = {int(i): part for i, part in (raw.get("per_layer_config") or {}).items()}
    if not overrides:
        full = {"head_dim": raw.get("global_head_dim") or 512}
        if k_eq_v and raw.get("num_global_key_value_heads"):
            full["num_key_value_heads"] = raw["num_global_key_value_heads"]
        overrides = {i: full for i, kind in enumerate(layer_types) if kind == "full_attention"}
    dims = [overrides.get(i, {}).get("head_dim", head_dim) for i in range(layers)]
    heads = [overrides.get(i, {}).get("num_key_value_heads", kv_heads) for i in range(layers)]
    shared = raw.get("num_kv_shared_layers") or 0
    first_shared, sources = layers - shared, list(range(layers))
    for i in range(first_shared, layers):
        stores = [j for j in range(first_shared) if layer_types[j] == layer_types[i]]
        if not stores:
            raise ValueError(f"Gemma 4 layer {i} shares the K/V of a {layer_types[i]} layer, and none stores its own")
        sources[i] = stores[-1]
    wide = 2 if raw.get("use_double_wide_mlp") else 1
    inner = raw["intermediate_size"]
    per_layer = raw.get("hidden_size_per_layer_input") or 0
    return {"layer_head_dims": dims, "layer_kv_heads": heads, "layer_kv_source": sources,
            "layer_values_are_keys": [k_eq_v and kind == "full_attention" for kind in layer_types],
            "layer_intermediate_sizes": [inner * (wide if i >= first_shared else 1) for i in range(layers)],
            "per_layer_input_size": per_layer,
            "per_layer_vocab_size": raw.get("vocab_size_per_layer_input", raw["vocab_size"]) if per_layer else 0}


def _encoder_features(raw: dict[str, Any], name: str, entry: registry.Architecture) -> dict[str, Any]:
    """BERT's, RoBERTa's and XLM-R's layout, as transformers builds them: positions from a learned
    table (RoBERTa's counted from padding_idx + 1), token types, LayerNorms after each residual
    add, biases throughout; a classifier class (one label per output) adds its score head.
    NomicBERT's: the same norms and token types, rotary positions, a SwiGLU MLP, no biases.
    ModernBERT's: pre-norm LayerNorms (biased where norm_bias says), the first layer's attention
    unnormed, a GeGLU MLP, biases where the config says, rotary positions."""
    if entry.encoder == "nomic":
        return {"causal": False, "layer_norm": True, "position_offset": 0, "embedding_norm": True,
                "type_vocab_size": raw.get("type_vocab_size", 2), "norm_style": "post_residual"}
    if entry.encoder == "modernbert":
        bias = raw.get("attention_bias", False)
        return {"causal": False, "layer_norm": True, "norm_bias": raw.get("norm_bias", False), "position_offset": 0,
                "embedding_norm": True, "type_vocab_size": 0, "mlp_bias": raw.get("mlp_bias", False),
                "attention_out_bias": bias, "first_layer_input_norm": False}
    kind = raw.get("position_embedding_type", "absolute")
    if kind != "absolute":
        raise ValueError(f"unsupported position_embedding_type {kind!r}; supported: absolute")
    offset = raw["pad_token_id"] + 1 if raw.get("model_type") in ("roberta", "xlm-roberta") else 0
    labels = num_labels(raw) if registry.is_classifier(name) else 0
    return {"causal": False, "layer_norm": True, "absolute_positions": True, "position_offset": offset,
            "type_vocab_size": raw.get("type_vocab_size", 2), "embedding_norm": True, "mlp_gated": False,
            "mlp_bias": True, "num_labels": labels, "norm_style": "post_residual", "attention_out_bias": True}


# nomic-embed-text's config.json (written for its own code) -> transformers' names
_NOMIC_KEYS = {"n_embd": "hidden_size", "n_head": "num_attention_heads", "n_layer": "num_hidden_layers",
               "n_inner": "intermediate_size", "n_positions": "max_position_embeddings",
               "layer_norm_epsilon": "layer_norm_eps", "rotary_emb_base": "rope_theta"}
# ... and the values of its switches that transformers' NomicBERT (and tailrace) implement
_NOMIC_FIXED = {"activation_function": "swiglu", "prenorm": False, "rotary_emb_fraction": 1.0,
                "rotary_emb_interleaved": False, "rotary_emb_scale_base": None, "qkv_proj_bias": False,
                "mlp_fc1_bias": False, "mlp_fc2_bias": False, "causal": False}


def _nomic_keys(raw: dict[str, Any]) -> dict[str, Any]:
    """A NomicBERT config in transformers' names, from either layout: nomic's own (n_embd, ...;
    the context its max_trained_positions says, as llama.cpp's converter serves it) or
    transformers'. A switch outside what the model implements is refused by name."""
    if "n_embd" not in raw:
        return raw
    for key, value in _NOMIC_FIXED.items():
        if key in raw and raw[key] != value:
            raise ValueError(f"unsupported NomicBERT {key}={raw[key]!r}; supported: {value!r}")
    out = {**raw, **{new: raw[old] for old, new in _NOMIC_KEYS.items() if old in raw}, "hidden_act": "silu"}
    trained = raw.get("max_trained_positions")
    if trained:
        out["max_position_embeddings"] = min(out["max_position_embeddings"], trained)
    return out


def _modernbert_keys(raw: dict[str, Any]) -> dict[str, Any]:
    """ModernBERT's config as the one decoder reads it: every global_attn_every_n_layers-th layer
    global from the first, the rest sliding; a sliding layer's query sees keys at most
    local_attention // 2 positions away on either side (the window here: strictly less than
    local_attention // 2 + 1); the global and local rotary bases, from transformers 5's
    rope_parameters or the older global_rope_theta and local_rope_theta."""
    layers, every = raw["num_hidden_layers"], raw.get("global_attn_every_n_layers", 3)
    out = {**raw, "sliding_window": raw.get("local_attention", 128) // 2 + 1,
           "layer_types": raw.get("layer_types") or ["sliding_attention" if i % every else "full_attention"
                                                     for i in range(layers)]}
    if "rope_parameters" not in raw:
        out |= {"rope_theta": raw.get("global_rope_theta", 160000.0),
                "rope_local_base_freq": raw.get("local_rope_theta", 10000.0)}
    return out


def _architecture(raw: dict[str, Any]) -> registry.Architecture:
    """The config's registry entry: by its class name, or for a config built by hand (not saved
    from a model) by its model_type."""
    if raw.get("architectures"):
        name = raw["architectures"][0]
    else:
        by_type = registry.by_model_type(raw.get("model_type", ""))
        name = by_type.name if by_type else ""
    if name not in SUPPORTED_ARCHITECTURES:
        shown = name or f"model_type {raw.get('model_type')!r}"
        raise ValueError(
            f"unsupported architecture {shown}; supported: {', '.join(sorted(SUPPORTED_ARCHITECTURES))}"
        )
    return registry.architecture(name)


def limit_context(config: ModelConfig, max_model_len: int | None) -> None:
    """The context served capped at `max_model_len` (None: the model's), in place. LongRoPE
    (Phi-3) takes its long factors where the context served is past the pretrained one, its short
    ones otherwise, as llama.cpp decides once for its context; transformers decides by each
    forward's length and vLLM by each batch's longest position, which would make a token depend
    on its batch. A learned table of positions keeps its checkpoint's rows (the runner caps the
    context served either way)."""
    if max_model_len is not None and not config.absolute_positions:
        config.max_position_embeddings = min(config.max_position_embeddings, max_model_len)
    scaling = config.rope_scaling
    if scaling is not None and scaling["rope_type"] == "longrope":
        scaling["long"] = config.max_position_embeddings > scaling["original_max_position_embeddings"]


def _rotary_dim(head_dim: int, fraction: float) -> int:
    dim = int(head_dim * fraction)
    if dim % 2 or not 0 < dim <= head_dim:
        raise ValueError(f"unsupported partial rotary: {dim} of {head_dim} dims rotate")
    return dim


def _rope(raw: dict[str, Any], max_positions: int) -> tuple[float, dict | None, float | None, float]:
    """(theta, scaling, local theta, the fraction of each head that rotates) from transformers 5's
    `rope_parameters` (Gemma 3: one set per layer type, the sliding layers' being the local one) or
    the older top-level `rope_theta` + `rope_scaling` (+ Gemma 3's `rope_local_base_freq`, Phi-3's
    `partial_rotary_factor` and `original_max_position_embeddings`). The local table is never
    scaled. LongRoPE's attention factor is worked out here from the model's full context, as
    transformers does."""
    params = raw.get("rope_parameters")
    local = raw.get("rope_local_base_freq")
    if isinstance(params, dict) and "full_attention" in params:
        local = params.get("sliding_attention", {}).get("rope_theta", local)
        params = params["full_attention"]
    if isinstance(params, dict):
        theta = params.get("rope_theta", raw.get("rope_theta", 10000.0))
        scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    else:
        theta = raw.get("rope_theta", 10000.0)
        scaling = dict(raw.get("rope_scaling") or {})
    local = None if local is None else float(local)
    fraction = float(scaling.pop("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0)))
    rope_type = scaling.pop("rope_type", None) or scaling.pop("type", None) or "default"
    scaling.pop("type", None)
    if rope_type == "su":  # Phi-3's first name for it
        rope_type = "longrope"
    if rope_type == "default":
        return float(theta), None, local, fraction
    if rope_type == "proportional":  # Gemma 4's: the pairs of the whole head, the slowest still (rope_inverse_frequencies)
        return float(theta), {"rope_type": "proportional", "fraction": fraction,
                              "factor": float(scaling.get("factor", 1.0))}, local, 1.0
    if rope_type not in SUPPORTED_ROPE_TYPES | _GGUF_ROPE_TYPES:
        raise ValueError(
            f"unsupported rope scaling type {rope_type!r}; supported: {', '.join(sorted(SUPPORTED_ROPE_TYPES))}"
        )
    if rope_type == "yarn":
        scaling.setdefault("original_max_position_embeddings", raw.get("original_max_position_embeddings"))
        factor = scaling.get("factor") or max_positions / scaling["original_max_position_embeddings"]
        scaling["factor"] = factor
        if scaling.get("attention_factor") is None:
            scaling["attention_factor"] = _yarn_mscale(factor, scaling.get("mscale"), scaling.get("mscale_all_dim"))
    if rope_type == "longrope":
        original = scaling.setdefault("original_max_position_embeddings",
                                      raw.get("original_max_position_embeddings", max_positions))
        factor = scaling.get("factor") or max_positions / original
        if scaling.get("attention_factor") is None:
            scaling["attention_factor"] = math.sqrt(1 + math.log(factor) / math.log(original)) if factor > 1 else 1.0
        scaling["long"] = max_positions > original
    return float(theta), {"rope_type": rope_type, **scaling}, local, fraction


def _experts(raw: dict[str, Any], entry: registry.Architecture, layers: int) -> dict[str, Any]:
    """The MoE fields: Qwen3-MoE's layers are sparse but for mlp_only_layers, every
    decoder_sparse_step-th; Mixtral's are all sparse and always renormalise their top k;
    Qwen3-Next's and Qwen3.5's are Qwen3-MoE's with a shared expert, renormalised unless the
    config says not; Gemma 4's (enable_moe_block) are every layer's, beside its MLP."""
    experts = raw.get("num_experts") or raw.get("num_local_experts") or 0
    if not entry.moe or not experts or (entry.moe == "gemma4" and not raw.get("enable_moe_block")):
        return {}
    top_k = raw["top_k_experts"] if entry.moe == "gemma4" else raw["num_experts_per_tok"]
    if not 0 < top_k <= experts:
        raise ValueError(f"num_experts_per_tok {top_k} must be between 1 and the {experts} experts")
    if entry.moe == "gpt_oss":
        return {"layer_moe": [True] * layers, "num_experts": experts, "experts_per_token": top_k,
                "moe_intermediate_size": raw["intermediate_size"], "moe_bias": True, "router_topk_first": True,
                "hidden_act": "swiglu_oai", "swiglu_alpha": raw.get("swiglu_alpha", 1.702),
                "swiglu_limit": raw.get("swiglu_limit", 7.0)}
    if entry.moe == "gemma4":  # every layer's, beside its MLP; the weights kept in float32, as the reference keeps them
        return {"layer_moe": [True] * layers, "num_experts": experts, "experts_per_token": top_k,
                "moe_intermediate_size": raw["moe_intermediate_size"], "norm_topk_prob": True, "router_float32": True,
                "experts_beside_mlp": True}
    mixtral, shared = entry.moe == "mixtral", entry.moe == "qwen3_next"
    dense, step = set(raw.get("mlp_only_layers") or []), raw.get("decoder_sparse_step") or 1
    return {
        "shared_expert_intermediate_size": raw.get("shared_expert_intermediate_size", 0) if shared else 0,
        "layer_moe": [mixtral or (i not in dense and (i + 1) % step == 0) for i in range(layers)],
        "num_experts": experts,
        "experts_per_token": top_k,
        "moe_intermediate_size": raw["intermediate_size"] if mixtral else raw["moe_intermediate_size"],
        "norm_topk_prob": mixtral or raw.get("norm_topk_prob", shared),
        "router_float32": mixtral,
    }


def _yarn_mscale(factor: float, mscale: float | None, mscale_all_dim: float | None) -> float:
    """YaRN's attention factor, as transformers works it out."""
    def get(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    return get(factor, mscale) / get(factor, mscale_all_dim) if mscale and mscale_all_dim else get(factor)


def _layer_types(raw: dict[str, Any], entry: registry.Architecture) -> list[str]:
    """Each layer's "full_attention", "sliding_attention" or (a hybrid's) "linear_attention": the
    config's `layer_types`, else the architecture's pattern as older configs imply it. A sliding
    layer attends fully where the config has no window (or, for Qwen's, does not use it)."""
    layers = raw["num_hidden_layers"]
    allowed = {"full_attention", "sliding_attention"} | ({"linear_attention"} if entry.gated_delta else set())
    if raw.get("layer_types"):
        types = list(raw["layer_types"])
        unknown = sorted(set(types) - allowed)
        if unknown:  # a hybrid's layer of a kind this architecture's entry does not serve (LFM2's "conv")
            raise ValueError(f"unsupported layer type {unknown[0]!r} in layer_types; {entry.name} serves "
                             f"{', '.join(sorted(allowed))}")
        if len(types) != layers:
            raise ValueError(f"layer_types must name one of {', '.join(sorted(allowed))} for each of {layers} layers")
    elif entry.gated_delta:
        every = raw.get("full_attention_interval", 4)
        types = ["full_attention" if (i + 1) % every == 0 else "linear_attention" for i in range(layers)]
    elif entry.sliding_period:
        pattern = raw.get("sliding_window_pattern") or raw.get("_sliding_window_pattern") or entry.sliding_period
        types = ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(layers)]
    else:
        types = ["sliding_attention" if raw.get("sliding_window") else "full_attention"] * layers
    if not raw.get("sliding_window") or (entry.window_needs_flag and not raw.get("use_sliding_window", False)):
        types = ["full_attention" if kind == "sliding_attention" else kind for kind in types]
    return types


def _layer_rope(raw: dict[str, Any], entry: registry.Architecture, layer_types: list[str],
                local_theta: float | None) -> list[str | None]:
    if entry.encoder == "bert":  # positions come from the embedding's table
        return [None] * len(layer_types)
    if entry.nope_interval:
        interval = raw.get("no_rope_layer_interval", entry.nope_interval)
        uses = raw.get("no_rope_layers") or [int((i + 1) % interval != 0) for i in range(len(layer_types))]
        return ["global" if use else None for use in uses]
    if local_theta is not None:
        return ["local" if kind == "sliding_attention" else "global" for kind in layer_types]
    return ["global"] * len(layer_types)


def num_labels(raw: dict[str, Any]) -> int:
    """A classifier's outputs, as transformers counts them: its id2label's, else num_labels (2)."""
    return len(raw.get("id2label") or {}) or raw.get("num_labels", 2)


def as_id_list(value: int | list[int] | None) -> list[int]:
    if value is None:
        return []
    return [value] if isinstance(value, int) else list(value)
