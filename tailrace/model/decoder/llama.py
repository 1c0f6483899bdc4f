"""The decoder of every supported architecture (Llama 2/3, Mistral, Qwen2, Qwen3, Qwen3-MoE,
Mixtral, gpt-oss, SmolLM3, Gemma 2 and 3, Phi-3, Granite, OLMo 2, Qwen3.5, Qwen3-Next) over one
flat batch of tokens: a Llama decoder with the features config.py reads for each architecture
(per-layer sliding windows and rotary tables, NoPE layers, partial rotary, GeGLU, multipliers,
soft caps, attention sinks, experts and a shared expert, gated attention output, Gated DeltaNet
layers in place of attention). Each layer runs the steps layer_plan.py makes (where the norms go, the residual's
multiplier), the same steps csrc/decoder.cpp runs in one call.

Parameters are named as in Hugging Face checkpoints, except that q/k/v and gate/up are fused
into `qkv_proj` and `gate_up_proj` (one matmul each instead of three and two; the loader
concatenates them, or reads them so from a Phi-3 checkpoint). Parameters are created
uninitialised: `loader.load_model` fills them.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from tailrace.model.attention import gated_delta
from tailrace.model.attention.whole_sequence import attend_whole
from tailrace.model.attention.kv_cache import AttentionBatch, KVCache, LayerAttention
from tailrace.model.attention.state_cache import StateCache, StateShape
from tailrace.model.decoder.config import ModelConfig
from tailrace.model.decoder.layer_plan import layer_steps, norms_of


def _empty(*shape: int, dtype: torch.dtype) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)


class Module(nn.Module):
    """nn.Module called straight through to forward: nothing here registers hooks, and
    nn.Module.__call__'s hook checks cost ~4 us a call, ~150 us of a ~2.5 ms decode step of the
    embedded model (about 40 calls a step)."""

    def __call__(self, *args: object) -> torch.Tensor:
        return self.forward(*args)


class Linear(Module):
    """nn.Linear without its random initialisation, which costs seconds on large models."""

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = _empty(out_features, in_features, dtype=dtype)
        self.bias = _empty(out_features, dtype=dtype) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class Embedding(Module):
    def __init__(self, num_embeddings: int, dim: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = _empty(num_embeddings, dim, dtype=dtype)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)


class RMSNorm(Module):
    def __init__(self, dim: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = _empty(dim, dtype=dtype)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # The reference implementation's arithmetic: normalise in float32, scale after casting back.
        return self.weight * rms_normalize(x, self.eps)


def rms_normalize(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x RMS-normed over its last dim without a scale (alone: Gemma 4's V), in float32, rounded
    once. Spelled out, it measured faster on CPU than F.rms_norm (~10 ops in aten)."""
    h = x.float()
    return (h * (h * h).mean(-1, keepdim=True).add_(eps).rsqrt_()).to(x.dtype)


class LayerNorm(Module):
    """An encoder's norm: mean and variance over the width, then scale and bias (nn.LayerNorm's arithmetic)."""

    def __init__(self, dim: int, eps: float, dtype: torch.dtype, bias: bool = True) -> None:
        super().__init__()
        self.weight = _empty(dim, dtype=dtype)
        self.bias = _empty(dim, dtype=dtype) if bias else None
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias, self.eps)


def make_norm(config: ModelConfig, dim: int, dtype: torch.dtype) -> RMSNorm | LayerNorm:
    if config.layer_norm:
        return LayerNorm(dim, config.rms_norm_eps, dtype, config.norm_bias)
    return RMSNorm(dim, config.rms_norm_eps, dtype)


def rotary_width(config: ModelConfig, kind: str) -> int:
    """The dims of a head that table `kind` turns: a partial rotary's rotary_dim, else the whole
    head of the layers it turns (Gemma 4's global layers' heads are wider than its local ones')."""
    return config.rotary_dim if config.rotary_dim < config.head_dim else config.rope_head_dim(kind)


def rope_inverse_frequencies(config: ModelConfig, kind: str = "global") -> torch.Tensor:
    """Per-pair rotation frequencies [rotary_width / 2], float32: the global table's with the configured
    scaling, or the local one's (config.local_rope_theta, unscaled). Proportional (Gemma 4's
    global layers): the first `fraction` of the pairs at the whole head's frequencies, the rest
    still (frequency 0: cos 1, sin 0)."""
    dim = rotary_width(config, kind)
    theta = config.rope_theta if kind == "global" else config.local_rope_theta
    scaling = config.rope_scaling if kind == "global" else None
    if scaling is not None and scaling["rope_type"] == "proportional":
        turning = int(scaling["fraction"] * dim // 2)
        inv_freq = 1.0 / theta ** (torch.arange(0, 2 * turning, 2, dtype=torch.int64).float() / dim)
        return F.pad(inv_freq, (0, dim // 2 - turning)) / scaling["factor"]
    powers = theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)
    if scaling is not None and scaling["rope_type"] == "longrope":
        factors = torch.tensor(scaling["long_factor" if scaling["long"] else "short_factor"], dtype=torch.float32)
        return 1.0 / (factors * powers)
    inv_freq = 1.0 / powers
    if scaling is None:
        return inv_freq
    if scaling["rope_type"] == "linear":
        return inv_freq / scaling["factor"]
    if scaling["rope_type"] == "freq_factors":
        return inv_freq / torch.tensor(scaling["factors"], dtype=torch.float32)
    if scaling["rope_type"] == "yarn":
        return _yarn_frequencies(powers, scaling, dim, theta)
    return _llama3_frequencies(inv_freq, scaling)


def _yarn_frequencies(powers: torch.Tensor, scaling: dict, dim: int, theta: float) -> torch.Tensor:
    """YaRN: frequencies that turn fewer than beta_slow times over the original context are
    slowed by `factor`, those that turn more than beta_fast times kept, a linear ramp between.
    powers: theta ** (2i / dim), the unscaled wavelengths over 2 pi."""
    original = scaling["original_max_position_embeddings"]

    def dims_turning(times: float) -> float:
        return dim * math.log(original / (times * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dims_turning(scaling.get("beta_fast") or 32), dims_turning(scaling.get("beta_slow") or 1)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low if high != low else 0.001)).clamp(0, 1)
    kept = 1 - ramp
    return 1.0 / (scaling["factor"] * powers) * (1 - kept) + 1.0 / powers * kept


def _llama3_frequencies(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    """Llama 3.1: long wavelengths slowed by `factor`, short ones kept, a smooth blend between."""
    factor = scaling["factor"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_context = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_context / low, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= old_context / high) & (wavelen <= old_context / low)
    return torch.where(is_medium, blended, scaled)


class Rotary(Module):
    """cos/sin tables for every position up to max_position_embeddings, built once in float32,
    each as wide as a head: cos repeated for both halves, sin negated for the first half (times
    LongRoPE's attention factor, as the reference scales them).

    A partial rotary (Phi-3: the first rotary_dim dims of a head turn, in pairs rotary_dim / 2
    apart) is the full rotation of a head whose q/k dims are reordered (rotary_order): the turning
    pairs come first in each half, the others after them with cos 1 and sin 0, exactly unchanged.
    q . k is the same sum in any order of dims, so every rotary kernel serves it as it is."""

    def __init__(self, config: ModelConfig, kind: str = "global") -> None:
        super().__init__()
        positions = torch.arange(config.max_position_embeddings, dtype=torch.float32)
        freqs = torch.outer(positions, rope_inverse_frequencies(config, kind))
        cos, sin = freqs.cos(), freqs.sin()
        scaling = config.rope_scaling if kind == "global" else None
        if scaling is not None and "attention_factor" in scaling:
            cos, sin = cos * scaling["attention_factor"], sin * scaling["attention_factor"]
        still = (config.rope_head_dim(kind) - rotary_width(config, kind)) // 2
        cos = F.pad(cos, (0, still), value=1.0)
        sin = F.pad(sin, (0, still), value=0.0)
        self.register_buffer("cos", torch.cat((cos, cos), dim=-1), persistent=False)
        self.register_buffer("sin", torch.cat((-sin, sin), dim=-1), persistent=False)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # [T, 1, D]: broadcast over heads
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)


def rotary_order(head_dim: int, rotary_dim: int) -> torch.Tensor:
    """The order of a head's q/k dims that makes a partial rotary a full one (see Rotary): the
    turning first halves, the still dims' first half, the turning second halves, the rest."""
    half, still = rotary_dim // 2, (head_dim - rotary_dim) // 2
    turning = torch.arange(rotary_dim)
    rest = torch.arange(rotary_dim, head_dim)
    return torch.cat((turning[:half], rest[:still], turning[half:], rest[still:]))


def qkv_row_order(config: ModelConfig) -> torch.Tensor:
    """The fused q/k/v projection's rows with each q and k head's dims in rotary_order (v's rows,
    and the output gate's, as they are)."""
    dim, qk_heads = config.head_dim, config.num_attention_heads + config.num_key_value_heads
    rows = (torch.arange(qk_heads)[:, None] * dim + rotary_order(dim, config.rotary_dim)).flatten()
    return torch.cat((rows, torch.arange(qk_heads * dim, qkv_rows(config))))


def qkv_rows(config: ModelConfig) -> int:
    """The fused projection's outputs: q, k, v, and with an output gate one more per q dim."""
    q_size = config.num_attention_heads * config.head_dim
    return q_size * (2 if config.attention_output_gate else 1) + 2 * config.num_key_value_heads * config.head_dim


def reorder_rotary_dims(model: LlamaForCausalLM) -> None:
    """A partial rotary's q/k dims put in rotary_order (see Rotary), in place: the projection's rows
    (and bias), and per-head q/k norms."""
    config = model.config
    if config.rotary_dim == config.head_dim:
        return
    rows, dims = qkv_row_order(config), rotary_order(config.head_dim, config.rotary_dim)
    with torch.no_grad():
        for layer in model.model.layers:
            attn = layer.self_attn
            if attn is None:
                continue
            for param, order in ((attn.qkv_proj.weight, rows), (attn.qkv_proj.bias, rows),
                                 (getattr(attn.q_norm, "weight", None), dims),
                                 (getattr(attn.k_norm, "weight", None), dims)):
                if param is not None:
                    param.copy_(param[order])


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The "rotate_half" convention: dims i and i + D/2 form a rotating pair. With the sign in
    the sin table, rotate_half(x) * sin is x rolled by D/2 times it: 4 ops instead of 8, same
    arithmetic."""
    if x.dtype != torch.float32:
        return apply_rotary(x.float(), cos, sin).to(x.dtype)
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * sin


class Attention(Module):
    """Softmax attention over the KV cache. With an output gate (Qwen3-Next), the fused projection's
    rows are q, k, v, then the gate (q_proj's other half per head, loader.py): the output times
    sigmoid(gate) goes to o_proj. A layer reading another's K/V (Gemma 4's shared layers) projects
    q alone and stores nothing; one whose values are its keys (Gemma 4's attention_k_eq_v)
    projects q and k, its V the k rows before their norm."""

    def __init__(self, config: ModelConfig, layer: int, dtype: torch.dtype) -> None:
        super().__init__()
        source = config.kv_source(layer)
        self.layer = config.attention_layers.index(source)  # the KV cache's layer it attends over
        self.stores = source == layer
        self.values_are_keys = config.values_are_keys(layer)
        self.num_heads = config.num_attention_heads
        self.num_kv_heads, self.head_dim = config.attention_shape(layer)
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        # q (and k), then v where it is its own, then the output gate
        self.gated = config.attention_output_gate
        parts = config.projected_parts(layer)
        self.split = [q_size + (kv_size if parts > 1 else 0)] + ([kv_size] if parts == 3 else []) + (
            [q_size] if self.gated else [])
        self.qkv_proj = Linear(config.hidden_size, sum(self.split), config.attention_bias, dtype)
        self.o_proj = Linear(q_size, config.hidden_size, config.attention_out_bias, dtype)
        # per head, or (OLMo 2) over all of q's and all of k's heads at once
        self.qk_norm_heads = config.qk_norm_over_heads
        q_width, k_width = (q_size, kv_size) if self.qk_norm_heads else (self.head_dim, self.head_dim)
        self.q_norm = RMSNorm(q_width, config.rms_norm_eps, dtype) if config.qk_norm else None
        self.k_norm = RMSNorm(k_width, config.rms_norm_eps, dtype) if config.qk_norm and self.stores else None
        self.v_eps = config.rms_norm_eps if config.value_norm else None
        self.rope = config.layer_rope[layer]  # which of the model's rotary tables, None for none
        self.how = LayerAttention(config.attention_scale, config.layer_windows[layer], config.attention_softcap,
                                  config.attention_sinks)
        self.sinks = _empty(self.num_heads, dtype=dtype) if config.attention_sinks else None
        self.causal = config.causal  # False: an encoder's, every row of a sequence sees all of it
        self.rotate = apply_rotary  # model/cpu/ops.py puts a one-call kernel here on CPU
        self.gate_mul = sigmoid_mul  # and here

    def forward(
        self,
        x: torch.Tensor,
        rotations: dict[str, tuple[torch.Tensor, torch.Tensor]],
        batch: AttentionBatch,
        cache: KVCache,
    ) -> torch.Tensor:
        parts = self.qkv_proj(x).split(self.split, dim=-1)
        gate = parts[-1] if self.gated else None
        kv_heads = self.num_kv_heads if self.stores else 0
        qk = parts[0].reshape(-1, self.num_heads + kv_heads, self.head_dim)
        v = None
        if self.stores:
            v = qk[:, self.num_heads:] if self.values_are_keys else parts[1].reshape(-1, kv_heads, self.head_dim)
            if self.v_eps is not None:
                v = rms_normalize(v, self.v_eps)
        if self.q_norm is not None:
            q, k = qk.split([self.num_heads, kv_heads], dim=1)
            if self.qk_norm_heads:
                q = self.q_norm(q.reshape(q.shape[0], -1)).view(q.shape)
                k = self.k_norm(k.reshape(k.shape[0], -1)).view(k.shape)
            else:
                q = self.q_norm(q)
                k = self.k_norm(k) if kv_heads else k
            qk = torch.cat((q, k), dim=1)
        if self.rope is not None:
            # q and k heads rotate together: one set of elementwise ops instead of two
            qk = self.rotate(qk, *rotations[self.rope])
        q, k = qk.split([self.num_heads, kv_heads], dim=1)
        if not self.stores:  # attends over the K/V an earlier layer stored this step
            out = cache.attend(self.layer, q, None, None, batch, self.how, self.sinks)
        elif cache.num_layers:
            out = cache.attend(self.layer, q, k, v, batch, self.how, self.sinks)
        else:  # a cache keeping no K/V: each sequence runs whole in this step
            out = attend_whole(q, k, v, batch, self.how, self.causal)
        out = out.reshape(x.shape[0], -1)
        if gate is not None:
            out = self.gate_mul(out, gate)
        return self.o_proj(out)


class GatedRMSNorm(Module):
    """Gated DeltaNet's output norm, per value head: x (float32 [T, heads, dim]) rounded to the
    gate's dtype, RMSNorm (weight times the normed x rounded to the dtype) times SiLU(gate) in
    float32, rounded once -> [T, heads * dim]."""

    def __init__(self, dim: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = _empty(dim, dtype=dtype)
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        normed = rms_normalize(x.to(gate.dtype), self.eps)
        return (self.weight * normed * F.silu(gate.float())).to(gate.dtype).flatten(1)


def sigmoid_mul(x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """x times sigmoid(gate) (one gate per row where gate is [T, 1]), the sigmoid rounded to the dtype."""
    return x * torch.sigmoid(gate)


def in_proj_split(config: ModelConfig) -> list[int]:
    """Gated DeltaNet's fused input projection's outputs: the convolved q, k and v channels, the
    output gate z, and one b and one a per value head."""
    value_size = config.linear_value_heads * config.linear_value_dim
    return [2 * config.linear_key_heads * config.linear_key_dim + value_size, value_size,
            config.linear_value_heads, config.linear_value_heads]


def state_shape(config: ModelConfig) -> StateShape:
    """One Gated DeltaNet layer's state per sequence, for the state cache."""
    return StateShape(in_proj_split(config)[0], config.linear_conv_kernel, config.linear_value_heads,
                      config.linear_key_dim, config.linear_value_dim)


class CausalConv(Module):
    """A depthwise causal convolution's weights [channels, 1, kernel], as checkpoints store them."""

    def __init__(self, channels: int, kernel: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = _empty(channels, 1, kernel, dtype=dtype)


class GatedDeltaNet(Module):
    """A Gated DeltaNet layer (Qwen3.5, Qwen3-Next): a linear attention whose per-sequence state
    (attention/state_cache.py) takes the place of a growing K/V. One fused projection gives the
    convolved q/k/v channels, the output gate z, and per value head beta's and the decay's inputs
    (b, a); after the causal convolution and the gated delta rule (attention/gated_delta.py), each
    value head's output is normed, gated by SiLU(z), and projected back."""

    def __init__(self, config: ModelConfig, layer: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.index = config.gated_delta_layers.index(layer)  # its layer of the state cache
        self.key_heads, self.key_dim = config.linear_key_heads, config.linear_key_dim
        self.value_heads, self.value_dim = config.linear_value_heads, config.linear_value_dim
        self.tiled = config.value_heads_tiled
        key_size, value_size = self.key_heads * self.key_dim, self.value_heads * self.value_dim
        self.split = in_proj_split(config)
        self.qkv_split = [key_size, key_size, value_size]
        self.in_proj = Linear(config.hidden_size, sum(self.split), False, dtype)
        self.conv1d = CausalConv(self.split[0], config.linear_conv_kernel, dtype)
        # each value head's decay rate, -exp(A_log) of the checkpoint's A_log (loader.py), as
        # llama.cpp's converter stores it and transformers computes it, in float32
        self.A = _empty(self.value_heads, dtype=torch.float32)
        self.dt_bias = _empty(self.value_heads, dtype=dtype)
        self.norm = GatedRMSNorm(self.value_dim, config.rms_norm_eps, dtype)
        self.out_proj = Linear(value_size, config.hidden_size, False, dtype)
        # model/cpu/ops.py puts the kernels here on CPU
        self.conv = gated_delta.causal_conv
        self.rule = gated_delta.delta_rule

    def forward(self, x: torch.Tensor, cache: KVCache) -> torch.Tensor:
        states: StateCache = cache.states  # the KV cache carries the model's states
        n = x.shape[0]
        mixed, z, b, a = self.in_proj(x).split(self.split, dim=-1)
        mixed = self.conv(mixed, self.conv1d.weight.view(self.split[0], -1), states.conv[self.index], states.step)
        q, k, v = mixed.split(self.qkv_split, dim=-1)
        out = self.rule(q.view(n, self.key_heads, self.key_dim), k.view(n, self.key_heads, self.key_dim),
                        v.view(n, self.value_heads, self.value_dim), a, b, self.A, self.dt_bias, self.tiled,
                        states.recurrent[self.index], states.step)
        return self.out_proj(self.norm(out, z.view(n, self.value_heads, self.value_dim)))


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def gelu_tanh_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


def swiglu_oai_and_mul(gate_up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """gpt-oss's gate: gate capped at limit, up clamped to +-limit, (up + 1) * gate * sigmoid(alpha gate)."""
    gate, up = gate_up.chunk(2, dim=-1)
    gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


def gelu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate) * up


ACT_AND_MUL = {"silu": silu_and_mul, "gelu_tanh": gelu_tanh_and_mul, "gelu": gelu_and_mul}
# An ungated activation (an encoder's MLP's, Gemma 4's per-layer input gate's)
ACTIVATIONS = {"gelu": F.gelu, "gelu_tanh": functools.partial(F.gelu, approximate="tanh"), "silu": F.silu}


class MLP(Module):
    """Gated (gate and up fused, the product of act(gate) and up), or (an encoder's) plain: act(up)."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype, inner: int | None = None) -> None:
        super().__init__()
        width, bias = config.hidden_size, config.mlp_bias
        inner = inner or config.intermediate_size
        self.act = config.hidden_act
        self.gated = config.mlp_gated
        if self.gated:
            self.gate_up_proj = Linear(width, 2 * inner, bias, dtype)
            self.act_and_mul = ACT_AND_MUL[self.act]  # model/cpu/ops.py puts a one-call kernel here on CPU
        else:
            self.up_proj = Linear(width, inner, bias, dtype)
            self.activation = ACTIVATIONS[self.act]
        self.down_proj = Linear(inner, width, bias, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gated:
            return self.down_proj(self.act_and_mul(self.gate_up_proj(x)))
        return self.down_proj(self.activation(self.up_proj(x)))


class Router(Linear):
    """A mixture of experts' router: a Linear that quantization and packing leave as it is
    (replace_projections replaces Linear itself, not its subclasses): a rounded logit can change
    which experts a token takes."""


class Expert(Module):
    """One expert's projections, gate and up fused (its SwiGLU runs in MoE.forward)."""

    def __init__(self, width: int, inner: int, bias: bool, dtype: torch.dtype) -> None:
        super().__init__()
        self.gate_up_proj = Linear(width, 2 * inner, bias, dtype)
        self.down_proj = Linear(inner, width, bias, dtype)


class MoE(Module):
    """A mixture of experts: the router ranks num_experts experts for each token (softmax in
    float32), and the token's output is its experts_per_token best experts' outputs, each times
    its router weight, summed in expert order. Each expert runs once a step on the tokens that
    chose it, reading only its own weights: the others' are not touched. An expert is a pair of
    projections (`Expert`), so quantization and packing take the experts as they take any
    projection."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        width, inner, bias = config.hidden_size, config.moe_intermediate_size, config.moe_bias
        self.gate = Router(width, config.num_experts, bias, dtype)
        self.experts = nn.ModuleList(Expert(width, inner, bias, dtype) for _ in range(config.num_experts))
        # choose_experts' switches: model/cpu/ops.py puts the kernel that takes the same ones in
        # `choose` on CPU, as it puts one-call kernels in `act_and_mul`
        self.routing = {"top_k": config.experts_per_token, "topk_first": config.router_topk_first,
                        "normalize": config.norm_topk_prob, "float32_weights": config.router_float32}
        self.choose = functools.partial(choose_experts, **self.routing)
        self.act = config.hidden_act
        self.act_and_mul = ACT_AND_MUL.get(self.act) or functools.partial(
            swiglu_oai_and_mul, alpha=config.swiglu_alpha, limit=config.swiglu_limit)
        # Qwen3-Next's: an expert every token takes, its output times sigmoid(shared_expert_gate(x))
        shared = config.shared_expert_intermediate_size
        self.shared_expert = Expert(width, shared, False, dtype) if shared else None
        self.shared_expert_gate = Router(width, 1, False, dtype) if shared else None
        self.gate_mul = sigmoid_mul  # model/cpu/ops.py puts a one-call kernel here on CPU
        # Gemma 4's: the router's input scale per channel and each expert's weight's scale
        self.router_scale = _empty(width, dtype=dtype) if config.experts_beside_mlp else None
        self.expert_scale = _empty(config.num_experts, dtype=dtype) if config.experts_beside_mlp else None
        self.eps = config.rms_norm_eps

    def forward(self, x: torch.Tensor, routed_by: torch.Tensor | None = None) -> torch.Tensor:
        """The experts of x, routed by x or (Gemma 4's, beside the MLP) by `routed_by`."""
        out = self._experts(x, x if routed_by is None else routed_by)
        if self.shared_expert is None:
            return out
        shared = self.shared_expert.down_proj(self.act_and_mul(self.shared_expert.gate_up_proj(x)))
        return out + self.gate_mul(shared, self.shared_expert_gate(x))

    def _experts(self, x: torch.Tensor, routed_by: torch.Tensor) -> torch.Tensor:
        weights, chosen = self.route(routed_by)
        out = torch.zeros_like(x)
        # the (row, slot) pairs grouped by expert, rows ascending in each group: one sort a step
        picks, top_k = chosen.flatten().argsort(stable=True), chosen.shape[1]
        counts = torch.bincount(chosen.flatten(), minlength=len(self.experts)).tolist()
        start = 0
        for expert, count in enumerate(counts):
            if count:
                rows, slots = picks[start:start + count] // top_k, picks[start:start + count] % top_k
                module = self.experts[expert]
                y = module.down_proj(self.act_and_mul(module.gate_up_proj(x[rows])))
                out.index_add_(0, rows, (y * weights[rows, slots, None]).to(x.dtype))
                start += count
        return out

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's experts_per_token router weights and experts [T, k]. Gemma 4's router reads x
        RMS-normed times its scale and hidden ** -0.5 (each product rounded to the dtype), and
        scales each chosen expert's (float32) weight by that expert's scale."""
        if self.router_scale is None:
            return self.choose(self.gate(x))
        weights, chosen = self.choose(self.gate(rms_normalize(x, self.eps) * self.router_scale * x.shape[-1] ** -0.5))
        return weights * self.expert_scale[chosen], chosen


def choose_experts(logits: torch.Tensor, top_k: int, topk_first: bool, normalize: bool,
                   float32_weights: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [T, E] -> each row's top_k weights and experts [T, k]: the softmax's top k in
    float32 (Qwen, Mixtral), renormalised to sum 1 with `normalize`, kept in float32 with
    `float32_weights` (Mixtral's reference) or rounded to the logits' dtype; or (`topk_first`,
    gpt-oss) the softmax of the top k logits, in their dtype."""
    if topk_first:
        top, chosen = torch.topk(logits, top_k, dim=-1)
        return F.softmax(top, dim=-1, dtype=top.dtype), chosen
    weights, chosen = torch.topk(F.softmax(logits.float(), dim=-1), top_k, dim=-1)
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return (weights if float32_weights else weights.to(logits.dtype)), chosen


class DecoderLayer(Module):
    """A layer's attention and feed-forward blocks, run by its steps (layer_plan.py, which also
    says which norms it has: checkpoint names, set here as attributes)."""

    def __init__(self, config: ModelConfig, layer: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.steps = layer_steps(config, layer)
        for name in norms_of(self.steps):
            setattr(self, name, make_norm(config, config.hidden_size, dtype))
        # the layer's mixer: attention over the KV cache, or Gated DeltaNet over the state cache
        linear = config.layer_mixers[layer] == "gated_delta"
        self.self_attn = None if linear else Attention(config, layer, dtype)
        self.linear_attn = GatedDeltaNet(config, layer, dtype) if linear else None
        beside = config.experts_beside_mlp and config.layer_moe[layer]  # Gemma 4's: both
        self.mlp = (MoE(config, dtype) if config.layer_moe[layer] and not beside
                    else MLP(config, dtype, config.intermediate_size_of(layer)))
        self.moe = MoE(config, dtype) if beside else None
        # Gemma 4's per-layer input, gated into h after the MLP, and the layer's output scalar
        if config.per_layer_input_size:
            self.per_layer_input_gate = Linear(config.hidden_size, config.per_layer_input_size, False, dtype)
            self.per_layer_projection = Linear(config.per_layer_input_size, config.hidden_size, False, dtype)
            self.per_layer_act = ACTIVATIONS[config.hidden_act]
        self.layer_scalar = _empty(1, dtype=dtype) if config.layer_scalars else None

    def forward(
        self,
        h: torch.Tensor,
        rotations: dict[str, tuple[torch.Tensor, torch.Tensor]],
        batch: AttentionBatch,
        cache: KVCache,
        per_layer: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """`per_layer`: this layer's per-layer inputs [T, per_layer_input_size] (Gemma 4's)."""
        x = y = h
        for step in self.steps:
            op = step.op
            if op == "read":
                x = h if step.norm is None else getattr(self, step.norm)(h)
            elif op == "attention":
                y = (self.self_attn(x, rotations, batch, cache) if self.linear_attn is None
                     else self.linear_attn(x, cache))
            elif op == "feed_forward":
                y = self.mlp(x)
            elif op == "norm_output":
                y = getattr(self, step.norm)(y)
            elif op == "scale":
                y = y * step.factor
            elif op == "add":
                h = h + y
            elif op == "per_layer_input":
                y = self.per_layer_projection(self.per_layer_act(self.per_layer_input_gate(x)) * per_layer)
            elif op == "scale_residual":
                h = h * self.layer_scalar
            elif op == "stash":
                stash = y
            elif op == "experts":
                y = self.moe(x, h)
            elif op == "add_stash":
                y = stash + y
            else:  # "norm_residual"
                h = getattr(self, step.norm)(h)
        return h


ROTARY_MODULES = {"global": "rotary", "local": "rotary_local"}  # a table's kind -> LlamaModel's attribute


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size, dtype)
        # An encoder's: learned positions and token types added to the embedding, the sum normed.
        if config.absolute_positions:
            self.embed_positions = Embedding(config.max_position_embeddings + config.position_offset,
                                             config.hidden_size, dtype)
        if config.type_vocab_size:
            self.embed_types = Embedding(config.type_vocab_size, config.hidden_size, dtype)
        if config.embedding_norm:
            self.embed_norm = make_norm(config, config.hidden_size, dtype)
        self.layers = nn.ModuleList(DecoderLayer(config, i, dtype) for i in range(config.num_hidden_layers))
        # None where each layer ends normed (an encoder's post-residual norms)
        self.norm = None if config.norm_style == "post_residual" else make_norm(config, config.hidden_size, dtype)
        # One module per rotary table a layer uses (attribute rotary / rotary_local).
        for kind in sorted({kind for kind in config.layer_rope if kind is not None}):
            setattr(self, "rotary" if kind == "global" else "rotary_local", Rotary(config, kind))
        # The embedding rows' multiplier (Gemma's sqrt(hidden)), rounded to the dtype as the reference does.
        self.embed_scale = None if config.embedding_multiplier == 1.0 else torch.tensor(config.embedding_multiplier,
                                                                                        dtype=dtype)
        # Gemma 4's per-layer inputs: a table of every layer's, and a projection of the embedding
        if config.per_layer_input_size:
            width = config.num_hidden_layers * config.per_layer_input_size
            self.embed_tokens_per_layer = Embedding(config.per_layer_vocab_size, width, dtype)
            self.per_layer_model_projection = Linear(config.hidden_size, width, False, dtype)
            self.per_layer_projection_norm = RMSNorm(config.per_layer_input_size, config.rms_norm_eps, dtype)
            self.per_layer_embed_scale = torch.tensor(config.per_layer_input_size**0.5, dtype=dtype)
        # model/cpu/ops.py puts the whole forward in one kernel call here on CPU (FusedForward), for
        # the steps whose cache it `takes`
        self.fused_forward = None


GROUP_ROWS = 512


def whole_sequence_groups(batch: AttentionBatch, num_rows: int) -> list[tuple[slice, AttentionBatch]]:
    """A step of whole sequences keeping no K/V (an encoder's, or any on a server that only pools)
    as groups of about GROUP_ROWS rows (one longer sequence alone), each its rows and its sequences
    counted from its first row: the layers run group by group. No row's result changes (a sequence
    attends only itself, and the projections give a row the same bits in any batch); each group's
    activations stay in the CPU's caches, where a whole step's (8,192 rows of a BERT-base MLP:
    100 MB) measured 28% slower a token (2-core AVX2, bench/embed.py --shape bge-base, batch 32)."""
    groups, start, seqs = [], 0, []
    for seq in batch.seqs:
        end = seq.q_start + seq.q_len
        if seqs and end - start > GROUP_ROWS:
            groups.append((start, seqs[-1].q_start + seqs[-1].q_len, seqs))
            start, seqs = seq.q_start, []
        seqs.append(seq)
    groups.append((start, num_rows, seqs))  # the last group keeps any padding rows after it
    return [(slice(a, b), AttentionBatch([dataclasses.replace(seq, q_start=seq.q_start - a) for seq in part],
                                         batch.slot_mapping[a:b])) for a, b, part in groups]


class ScoreHead(Module):
    """A sequence classifier's head on one token's hidden state: out_proj(tanh(dense(h))), as
    BERT's pooler and classifier and RoBERTa's classification head compute it."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.dense = Linear(config.hidden_size, config.hidden_size, True, dtype)
        self.out_proj = Linear(config.hidden_size, config.num_labels, True, dtype)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.out_proj(torch.tanh(self.dense(h)))


class PooledDense(Module):
    """A sentence-transformers Dense module, run on a pooled vector: its activation of linear(v)."""

    def __init__(self, linear: Linear, activation: str) -> None:
        super().__init__()
        self.linear = linear
        self.out_features = linear.weight.shape[0]
        self.activation = activation  # "identity" or "tanh"

    def forward(self, v: torch.Tensor) -> torch.Tensor:
        y = self.linear(v)
        return torch.tanh(y) if self.activation == "tanh" else y


class LlamaForCausalLM(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.config = config
        self.dtype = dtype
        self.model = LlamaModel(config, dtype)
        # None when tied: the logits read the embedding table (quantization may set its own head).
        self.lm_head = None
        if not config.tie_word_embeddings:
            self.lm_head = Linear(config.hidden_size, config.vocab_size, False, dtype)
        self.score = ScoreHead(config, dtype) if config.num_labels else None
        # An embedding model's Dense modules after pooling (loader.load_model reads them), in order
        self.dense = nn.ModuleList()
        # A causal reranker's LogitScore tokens (true, false or None): pooling "logits" scores with them
        self.logit_score: tuple[int, int | None] | None = None

    @property
    def embedding_size(self) -> int:
        """The length of a pooled vector: the last Dense module's outputs, else the hidden size."""
        return self.dense[-1].out_features if len(self.dense) else self.config.hidden_size

    @torch.inference_mode()
    def pooled_vector(self, states: torch.Tensor, method: str) -> torch.Tensor:
        """A pooling sequence's final hidden states [rows, hidden] (float32) -> its vector (float32):
        their mean ("mean") or its one row, through the Dense modules; "score": the classifier's
        outputs on the first row; "logits": the last row's logit of the LogitScore true token, less
        that of its false token."""
        if method == "score":
            return self.score(states[:1].to(self.dtype))[0].float()
        if method == "logits":
            true, false = self.logit_score
            logits = self.compute_logits(states[-1:].to(self.dtype))[0]
            return (logits[true] - (0.0 if false is None else logits[false]))[None]
        vector = states.mean(0) if method == "mean" else states[0]
        for layer in self.dense:
            vector = layer(vector[None].to(self.dtype))[0].float()
        return vector

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        batch: AttentionBatch,
        cache: KVCache,
        rows: list[int] | None = None,
        token_types: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """input_ids, positions [T] -> final hidden states [T, hidden], or only those of `rows`
        (ascending) [len(rows), hidden]: every row's K/V is stored either way; `cache.begin(batch)`
        first. `token_types` [T]: an encoder's token types (None: all 0)."""
        if rows is not None and len(rows) == len(input_ids):  # ascending distinct rows: every row
            rows = None
        fused = self.model.fused_forward
        if fused is not None and fused.takes(cache):
            return fused(input_ids, positions, batch, cache, rows)
        if cache.num_layers:
            h, narrowed = self._hidden(input_ids, positions, batch, cache, token_types, rows)
            if narrowed:
                return h
        else:
            h = torch.cat([self._hidden(input_ids[group], positions[group], part, cache,
                                        None if token_types is None else token_types[group])[0]
                           for group, part in whole_sequence_groups(batch, len(input_ids))])
        if rows is None:
            return h
        # pinned, and queued without waiting: a pageable copy to a GPU would wait for the forward
        index = torch.tensor(rows, dtype=torch.long, pin_memory=h.is_cuda).to(h.device, non_blocking=True)
        return h[index]

    def _hidden(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: AttentionBatch, cache: KVCache,
                token_types: torch.Tensor | None, rows: list[int] | None = None) -> tuple[torch.Tensor, bool]:
        """Every row's final hidden state, by the modules; or (True) only those of `rows`: past the
        first layer that reads another's K/V, every layer stores none, so the rows not wanted
        stop there where the cache can attend for the wanted ones alone (Gemma 4's prompts: 20
        of E2B's 35 layers, and its double-wide MLPs, run for each prompt's last row only)."""
        h = self.model.embed_tokens(input_ids)
        if self.model.embed_scale is not None:
            h = h * self.model.embed_scale
        if self.config.type_vocab_size:
            h = h + self.model.embed_types(torch.zeros_like(input_ids) if token_types is None else token_types)
        if self.config.absolute_positions:
            h = h + self.model.embed_positions(positions + self.config.position_offset)
        if self.config.embedding_norm:
            h = self.model.embed_norm(h)
        rotations = {kind: getattr(self.model, name)(positions) for kind, name in ROTARY_MODULES.items()
                     if hasattr(self.model, name)}
        per_layer = self._per_layer_inputs(input_ids, h) if self.config.per_layer_input_size else None
        narrow_at = self.config.first_kv_reader if rows is not None else None
        narrowed = False
        for index, layer in enumerate(self.model.layers):
            if index == narrow_at and (part := cache.narrow(batch, rows)) is not None:
                if not rows:  # no row wanted: a prompt's chunk before its last
                    return h[:0], True
                keep = torch.tensor(rows, dtype=torch.long, device=h.device)
                h, batch, narrowed = h[keep], part, True
                per_layer = None if per_layer is None else per_layer[keep]
                rotations = {kind: (cos[keep], sin[keep]) for kind, (cos, sin) in rotations.items()}
            h = layer(h, rotations, batch, cache, None if per_layer is None else per_layer[:, index])
        if self.model.norm is not None:
            h = self.model.norm(h)
        return h, narrowed

    def _per_layer_inputs(self, input_ids: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        """Gemma 4's per-layer inputs [T, layers, per_layer_input_size]: each token's rows of the
        per-layer table (times sqrt(width), rounded to the dtype), and the scaled embedding h
        projected (times hidden ** -0.5) and normed per layer, summed, times 2 ** -0.5."""
        model, width = self.model, self.config.per_layer_input_size
        table = model.embed_tokens_per_layer(input_ids) * model.per_layer_embed_scale
        projected = model.per_layer_model_projection(h) * self.config.hidden_size**-0.5
        projected = model.per_layer_projection_norm(projected.view(len(input_ids), -1, width))
        return (projected + table.view(len(input_ids), -1, width)) * 2**-0.5

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden] -> logits [N, vocab] in float32 (soft-capped where the config says)."""
        if self.lm_head is None:
            logits = F.linear(hidden, self.model.embed_tokens.weight).float()
        else:
            logits = self.lm_head(hidden).float()
        if self.config.logit_divisor != 1.0:  # Granite's logits_scaling
            logits = logits / self.config.logit_divisor
        cap = self.config.final_logit_softcap
        return logits if cap is None else (logits / cap).tanh_().mul_(cap)


def replace_modules(model: nn.Module, kind: type[nn.Module], make: Callable[[nn.Module], nn.Module]) -> None:
    """Every submodule of type `kind` (not of a subclass) replaced in place by make(it)."""
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is kind:
                setattr(parent, name, make(child))


def replace_elementwise(model: LlamaForCausalLM, norm: Callable[[RMSNorm], Module],
                        rotate: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],
                        act_and_mul: dict[str, Callable[[torch.Tensor], torch.Tensor]]) -> LlamaForCausalLM:
    """Every RMSNorm replaced in place by norm(it), and every attention's rotary embedding and every
    MLP's activation-and-multiply (by its activation's name) by these functions: how a device's own
    kernels for them enter the model (model/cpu/ops.py, model/gpu/triton_ops.py)."""
    replace_modules(model, RMSNorm, norm)
    for module in model.modules():
        if isinstance(module, Attention):
            module.rotate = rotate
        elif isinstance(module, (MLP, MoE)) and module.act in act_and_mul and getattr(module, "gated", True):
            module.act_and_mul = act_and_mul[module.act]
    return model


def replace_projections(
    model: LlamaForCausalLM, make: Callable[[torch.Tensor, torch.Tensor | None], nn.Module]
) -> None:
    """Every Linear, and the LM head of a tied model (otherwise the embedding table), replaced in
    place by make(weight, bias): how quantized and packed projections enter the model. The
    embedding lookup keeps the plain table."""
    with torch.no_grad():
        replace_modules(model, Linear, lambda linear: make(linear.weight, linear.bias))
        if model.lm_head is None:
            model.lm_head = make(model.model.embed_tokens.weight, None)
