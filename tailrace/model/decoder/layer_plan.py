"""A decoder layer described once: the ordered steps of its two blocks, made from config.py's
features, which `llama.DecoderLayer` runs module by module and csrc/decoder.cpp runs in one call.

The steps move rows between three registers: h (the residual stream), x (a block's input) and y
(a block's output). Where each architecture puts its norms and multipliers is only the order of
steps here, so an architecture that combines them differently (Gemma's sandwich norms, OLMo 2's
output norms, Granite's residual multiplier) is written in this file alone; each step's
arithmetic is written once per path (the PyTorch reference and the kernel), with the same
rounding points, so both give the same bits (tests/test_fused_forward.py runs random orders
through both).
"""

from __future__ import annotations

from dataclasses import dataclass

from tailrace.model.decoder.config import ModelConfig

# read: x = norm(h), or h itself without a norm; attention: y = the attention of x (q/k/v, q/k
# norms, rotary, the K/V stored, o_proj); feed_forward: y = the MLP or the mixture of experts of
# x; per_layer_input: y = per_layer_projection(act(per_layer_input_gate(x)) * the layer's
# per-layer input) (Gemma 4's); norm_output: y = norm(y); scale: y = y * factor; add: h = h + y;
# norm_residual: h = norm(h) (an encoder's); scale_residual: h = h * the layer's layer_scalar
# (Gemma 4's); stash: s = y; experts: y = the layer's experts of x, routed by h; add_stash: y = s + y
# (Gemma 4's experts beside its MLP). The one-call forward runs neither the encoder's nor Gemma
# 4's. Each product and sum is rounded to the model's dtype once, as eager PyTorch rounds it.
OPS = ("read", "attention", "feed_forward", "per_layer_input", "norm_output", "scale", "add", "norm_residual",
       "scale_residual", "stash", "experts", "add_stash")

# A layer's norms by the checkpoint's names, which a step names: RMSNorms over the hidden width
NORMS = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm",
         "post_per_layer_input_norm", "post_feedforward_layernorm_1", "pre_feedforward_layernorm_2",
         "post_feedforward_layernorm_2")


@dataclass(frozen=True, slots=True)
class Step:
    op: str  # one of OPS
    norm: str | None = None  # the layer's norm that read and norm_output apply (one of NORMS)
    factor: float = 1.0  # scale's


# Per norm style: each block's input norm and output norm ("pre": Llama's inputs only, the MLP's
# under the name post_attention_layernorm; "sandwich": Gemma's inputs and outputs; "post": OLMo
# 2's outputs only). "post_residual" (BERT's) norms the residual stream after each add instead.
_RESIDUAL_NORMS = ("post_attention_layernorm", "post_feedforward_layernorm")
_BLOCK_NORMS = {
    "pre": (("input_layernorm", None), ("post_attention_layernorm", None)),
    "sandwich": (("input_layernorm", "post_attention_layernorm"),
                 ("pre_feedforward_layernorm", "post_feedforward_layernorm")),
    "post": ((None, "post_attention_layernorm"), (None, "post_feedforward_layernorm")),
    "post_residual": ((None, None), (None, None)),
}


def layer_steps(config: ModelConfig, layer: int = 1) -> tuple[Step, ...]:
    """Layer `layer`'s steps: for the attention block and then the feed-forward block, its input
    read (normed or not: ModernBERT's first attention reads h as it is), the block, its output's
    norm where the style norms outputs, its output times the residual multiplier where there is
    one (Granite), its output added to h, and h normed where the style norms the residual (BERT);
    Gemma 4's experts beside its MLP, each through its own norms, summed before the block's output norm;
    then Gemma 4's per-layer input, normed and added, and h times the layer's scalar."""
    steps: list[Step] = []
    unnormed_first = not config.first_layer_input_norm and layer == 0
    blocks = zip(("attention", "feed_forward"), _BLOCK_NORMS[config.norm_style], _RESIDUAL_NORMS)
    for block, (input_norm, output_norm), residual_norm in blocks:
        if unnormed_first and block == "attention":
            input_norm = None
        steps += [Step("read", input_norm), Step(block)]
        if block == "feed_forward" and config.experts_beside_mlp and config.layer_moe[layer]:
            steps += [Step("norm_output", "post_feedforward_layernorm_1"), Step("stash"),
                      Step("read", "pre_feedforward_layernorm_2"), Step("experts"),
                      Step("norm_output", "post_feedforward_layernorm_2"), Step("add_stash")]
        if output_norm is not None:
            steps.append(Step("norm_output", output_norm))
        if config.residual_multiplier != 1.0:
            steps.append(Step("scale", factor=config.residual_multiplier))
        steps.append(Step("add"))
        if config.norm_style == "post_residual":
            steps.append(Step("norm_residual", residual_norm))
    if config.per_layer_input_size:
        steps += [Step("read"), Step("per_layer_input"), Step("norm_output", "post_per_layer_input_norm"),
                  Step("add")]
    if config.layer_scalars:
        steps.append(Step("scale_residual"))
    return tuple(steps)


def norms_of(steps: tuple[Step, ...]) -> list[str]:
    """The norms the steps apply, each once, in NORMS' order."""
    used = {step.norm for step in steps}
    return [name for name in NORMS if name in used]


@dataclass(frozen=True, slots=True)
class LayerPlan:
    steps: tuple[Step, ...]
    window: int  # the positions a query sees back from itself; 0: all
    rope: str | None  # the rotary table it turns q/k by ("global" / "local"), None: no positions (NoPE)
    moe: bool  # its MLP is a mixture of experts


@dataclass(frozen=True, slots=True)
class ForwardPlan:
    """A model's forward from token ids to the final norm, described once: the model-wide numbers
    (what csrc/decoder.cpp's ForwardSpec holds, field for field) and each layer's plan. What else
    the forward needs comes as weights and tables (OUTSIDE_PLAN says which)."""

    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    eps: float
    act: str  # "silu", "gelu_tanh" or "swiglu_oai" (with swiglu_alpha and swiglu_limit)
    embedding_multiplier: float  # the embedding rows times it, rounded to the dtype first (1: none)
    scale: float  # q.k's
    softcap: float  # the attention scores' (0: none)
    swiglu_alpha: float
    swiglu_limit: float
    moe_intermediate: int
    experts_per_token: int  # 0: a dense model
    topk_first: bool
    normalize_topk: bool
    router_float32: bool
    layers: tuple[LayerPlan, ...]

    def numbers(self) -> dict[str, object]:
        """The model-wide fields, as the kernel's ForwardSpec takes them."""
        return {name: getattr(self, name) for name in self.__slots__ if name != "layers"}


def forward_plan(config: ModelConfig) -> ForwardPlan:
    experts = config.experts_per_token
    layers = tuple(LayerPlan(layer_steps(config, i), window or 0, rope, moe)
                   for i, (window, rope, moe) in enumerate(zip(config.layer_windows, config.layer_rope,
                                                               config.layer_moe)))
    return ForwardPlan(
        hidden=config.hidden_size, heads=config.num_attention_heads, kv_heads=config.num_key_value_heads,
        head_dim=config.head_dim, intermediate=config.intermediate_size, vocab=config.vocab_size,
        eps=config.rms_norm_eps, act=config.hidden_act, embedding_multiplier=config.embedding_multiplier,
        scale=config.attention_scale, softcap=config.attention_softcap or 0.0, swiglu_alpha=config.swiglu_alpha,
        swiglu_limit=config.swiglu_limit, moe_intermediate=config.moe_intermediate_size,
        experts_per_token=experts if any(config.layer_moe) else 0,
        topk_first=config.router_topk_first, normalize_topk=config.norm_topk_prob,
        router_float32=config.router_float32, layers=layers)


# Every ModelConfig field forward_plan does not read, and how it reaches the forward (or why it
# does not): tests/test_layer_plan.py fails on a field that is in neither, so a new feature cannot
# be left out of the one-call forward unnoticed.
OUTSIDE_PLAN = {
    "architecture": "named only; its features are the other fields",
    "num_hidden_layers": "the number of layer plans",
    "rope_theta": "the rotary tables (llama.Rotary), passed as cos/sin",
    "rope_scaling": "the rotary tables",
    "local_rope_theta": "the rotary tables",
    "rotary_dim": "the rotary tables and the q/k rows' order (llama.reorder_rotary_dims)",
    "max_position_embeddings": "the rotary tables' length and the context served",
    "tie_word_embeddings": "which table the embedding reads",
    "attention_bias": "the q/k/v bias buffers",
    "attention_out_bias": "o_proj's bias buffer",
    "moe_bias": "the router's and experts' bias buffers",
    "qk_norm": "the q/k norm weights, present or not",
    "qk_norm_over_heads": "the q/k norm weights' width (all heads, or one)",
    "norm_weight_offset": "folded into the norm weights at load",
    "attention_sinks": "each layer's sinks tensor",
    "num_experts": "each layer's experts",
    "logit_divisor": "applied to the logits, after the forward's final norm",
    "final_logit_softcap": "applied to the logits, after the forward's final norm",
    "torch_dtype": "how the checkpoint is stored, not how it runs",
    "bos_token_id": "the tokenizer's",
    "eos_token_ids": "the engine's stop tokens",
    # An encoder's forward runs module by module (backends refuses it the one-call forward).
    "causal": "an encoder's: not in the one-call forward",
    "layer_norm": "an encoder's: not in the one-call forward",
    "absolute_positions": "an encoder's: not in the one-call forward",
    "position_offset": "an encoder's: not in the one-call forward",
    "type_vocab_size": "an encoder's: not in the one-call forward",
    "embedding_norm": "an encoder's: not in the one-call forward",
    "mlp_gated": "an encoder's: not in the one-call forward",
    "mlp_bias": "an encoder's: not in the one-call forward",
    "num_labels": "the score head, after the forward",
    "norm_bias": "an encoder's: not in the one-call forward",
    # A hybrid's forward runs module by module (backends refuses it the one-call forward).
    "layer_mixers": "a hybrid's Gated DeltaNet layers: not in the one-call forward",
    "linear_key_heads": "a hybrid's: not in the one-call forward",
    "linear_key_dim": "a hybrid's: not in the one-call forward",
    "linear_value_heads": "a hybrid's: not in the one-call forward",
    "linear_value_dim": "a hybrid's: not in the one-call forward",
    "linear_conv_kernel": "a hybrid's: not in the one-call forward",
    "value_heads_tiled": "a hybrid's: not in the one-call forward",
    "attention_output_gate": "a hybrid's gated attention: not in the one-call forward",
    "shared_expert_intermediate_size": "a hybrid's shared expert: not in the one-call forward",
    # Gemma 4's forward runs module by module (backends refuses it the one-call forward).
    "layer_kv_heads": "Gemma 4's per-layer shapes: not in the one-call forward",
    "layer_head_dims": "Gemma 4's per-layer shapes: not in the one-call forward",
    "layer_intermediate_sizes": "Gemma 4's double-wide MLPs: not in the one-call forward",
    "layer_kv_source": "Gemma 4's shared K/V: not in the one-call forward",
    "layer_values_are_keys": "Gemma 4's: not in the one-call forward",
    "value_norm": "Gemma 4's: not in the one-call forward",
    "per_layer_vocab_size": "Gemma 4's per-layer inputs: not in the one-call forward",
}
