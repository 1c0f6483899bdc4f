"""A loaded model's steps through tailrace's CPU kernels (csrc/).

In eager PyTorch, RMSNorm, the rotary embedding and SiLU(gate) * up take about 20 small ops a
layer (dtype casts, a reduction, a roll), and at one decode row each op's dispatch costs more
than its arithmetic. Each kernel (csrc/elementwise.cpp) is one call with the reference
implementation's rounding points; bfloat16 results are bitwise the eager ones
(tests/test_cpu_ops.py).

With those and the packed projections in place, a step still made about ten calls a layer
through Python modules and the dispatcher. `FusedForward` (csrc/decoder.cpp) runs a bfloat16 or
float32 model's forward, from the embedding lookup through every layer to the final norm, in one call to
the same kernel functions, in the same order with the same rounding points, so it gives the
per-module path's bits in any batch (tests/test_fused_forward.py) and the engine's exactness holds
on either path; it takes a fifth or more off a batch-1 decode step of a small model
(bench/decode_step.py).
"""

from __future__ import annotations

import functools

import torch

from tailrace.model.attention.kv_cache import AttentionBatch, KVCache
from tailrace.model.attention.paged import PagedKVCache
from tailrace.model.attention.state_cache import StateStep
from tailrace.model.cpu.bf16_linear import Bf16Linear, Float32Linear, PackedEmbedding
from tailrace.heap import release_freed
from tailrace.model.cpu.huge_pages import Arena
from tailrace.model.cpu.int_linear import IntEmbedding, IntLinear, IntLinearParts
from tailrace.model.cpu.kernels import kernels
from tailrace.model.cpu.linear import pack_linears, pack_routers
from tailrace.model.decoder.config import ModelConfig
from tailrace.model.decoder.layer_plan import LayerPlan, forward_plan
from tailrace.model.decoder.llama import (ROTARY_MODULES, Attention, DecoderLayer, GatedDeltaNet, GatedRMSNorm,
                                          LlamaForCausalLM, Module, MoE, RMSNorm, replace_elementwise)



class KernelRMSNorm(Module):
    def __init__(self, norm: RMSNorm) -> None:
        super().__init__()
        self.weight = norm.weight
        self.eps = norm.eps
        self._rms_norm = kernels().rms_norm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._rms_norm(x, self.weight, self.eps)


def use_cpu_kernels(model: LlamaForCausalLM) -> LlamaForCausalLM:
    """Every RMSNorm, rotary embedding, activation-and-multiply, choice of experts and Gated
    DeltaNet recurrence of the model through the kernels, in place."""
    ops = kernels()
    replace_elementwise(model, KernelRMSNorm, ops.rotary, _act_and_mul(model.config))
    for module in model.modules():
        if isinstance(module, MoE):
            module.choose = functools.partial(ops.route_experts, **module.routing)
        if isinstance(module, (MoE, Attention)):
            module.gate_mul = ops.sigmoid_mul
        elif isinstance(module, GatedDeltaNet):
            module.conv, module.rule = kernel_causal_conv, kernel_delta_rule
            module.norm = KernelGatedNorm(module.norm)
    return model


class KernelGatedNorm(Module):
    def __init__(self, norm: GatedRMSNorm) -> None:
        super().__init__()
        self.weight = norm.weight
        self.eps = norm.eps
        self._gated_norm = kernels().gated_norm

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        return self._gated_norm(x, gate, self.weight, self.eps)


def kernel_causal_conv(x: torch.Tensor, weight: torch.Tensor, states: torch.Tensor, step: StateStep) -> torch.Tensor:
    """gated_delta.causal_conv on the kernel."""
    return kernels().causal_conv(x, weight, states, step.starts, step.slots, step.captures, step.capture_slots)


def kernel_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                      decay_rate: torch.Tensor, dt_bias: torch.Tensor, tiled: bool, states: torch.Tensor,
                      step: StateStep) -> torch.Tensor:
    """gated_delta.delta_rule on the kernel."""
    return kernels().delta_rule(q, k, v, a, b, decay_rate, dt_bias, tiled, states, step.starts, step.slots,
                                step.captures, step.capture_slots)


def _act_and_mul(config: ModelConfig) -> dict:
    ops = kernels()
    return {"silu": ops.silu_mul, "gelu_tanh": ops.gelu_tanh_mul,
            "swiglu_oai": functools.partial(ops.swiglu_oai_mul, alpha=config.swiglu_alpha, limit=config.swiglu_limit)}


def runs_kernel(function: object) -> bool:
    """function is one of the kernels' (or a partial of one)."""
    return getattr(function, "func", function) in vars(kernels()).values()


def is_kernel_norm(norm: Module, eps: float) -> bool:
    return type(norm) is KernelRMSNorm and norm.eps == eps


class FusedForward:
    """A model's forward, token ids to the final norm, as one kernel call, for steps whose cache
    `takes` says it can use."""

    def __init__(self, model: LlamaForCausalLM) -> None:
        plan = forward_plan(model.config)
        self.dtype = model.dtype
        spec = kernels().ForwardSpec()
        for name, value in plan.numbers().items():
            setattr(spec, name, value)  # a field the kernel's spec lacks fails here
        forward = kernels().DecoderForward if model.dtype == torch.bfloat16 else kernels().DecoderForwardFloat32
        self._forward = forward(spec)
        tables = [getattr(model.model, name) for name in ROTARY_MODULES.values() if hasattr(model.model, name)]
        table_index = {kind: i for i, kind in enumerate(kind for kind, name in ROTARY_MODULES.items()
                                                        if hasattr(model.model, name))}
        for layer, layer_plan in zip(model.model.layers, plan.layers):
            self._add_layer(layer, layer_plan, table_index)
        embed = model.model.embed_tokens
        table, packed, codes = ((torch.empty(0), False, embed.buffers_in_order) if isinstance(embed, IntEmbedding)
                                else (embed.packed, True, []) if isinstance(embed, PackedEmbedding)
                                else (embed.weight, False, []))
        self._forward.set_outer(embedding=table, packed=packed,
                                rotary=[t for table in tables for t in (table.cos, table.sin)],
                                final_norm=model.model.norm.weight, embedding_codes=codes)

    def _add_layer(self, layer: DecoderLayer, plan: LayerPlan, table_index: dict[str, int]) -> None:
        """One layer's plan and weights: its steps as the module runs them (layer_plan.layer_steps),
        each projection's buffers, its norms' weights, its sinks."""
        attn, mlp = layer.self_attn, layer.mlp
        experts = mlp.experts if plan.moe else []
        self._forward.add_layer(
            steps=[(step.op, step.norm and getattr(layer, step.norm).weight, step.factor) for step in layer.steps],
            qkv=_buffers(attn.qkv_proj), q_norm=_weight(attn.q_norm), k_norm=_weight(attn.k_norm),
            o=_buffers(attn.o_proj), gate_up=[] if experts else _buffers(mlp.gate_up_proj),
            down=[] if experts else _buffers(mlp.down_proj),
            rope=-1 if plan.rope is None else table_index[plan.rope], window=plan.window,
            sinks=attn.sinks, router=_buffers(mlp.gate) if experts else [],
            expert_gate_up=[_buffers(expert.gate_up_proj) for expert in experts],
            expert_down=[_buffers(expert.down_proj) for expert in experts])

    def takes(self, cache: KVCache | PagedKVCache) -> bool:
        """Attention read from the pages by tailrace's kernel, at the model's dtype."""
        return isinstance(cache, PagedKVCache) and cache.kernel == "tailrace" and cache.dtype == self.dtype

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: AttentionBatch,
                 cache: PagedKVCache, rows: list[int] | None = None) -> torch.Tensor:
        """The final norm's rows, or only those of `rows` (ascending, fewer than all)."""
        meta = cache.step_metadata(batch)
        wanted = None if rows is None else torch.tensor(rows, dtype=torch.long)
        return self._forward.forward(input_ids, positions, cache.k, cache.v, batch.slot_mapping, meta.query_start_loc,
                                     meta.seq_lens, meta.block_tables, meta.block_size, meta.num_seqs, wanted)


# The buffers of the projections tailrace's kernels stream (a bias is added, not streamed).
_STREAMED = {Bf16Linear: ("packed",), Float32Linear: ("packed",), IntLinear: IntLinear.BUFFERS}
def _buffers(projection: Bf16Linear | Float32Linear | IntLinear | IntLinearParts) -> list[torch.Tensor | None]:
    """A projection's weights as DecoderForward.add_layer takes them: what it streams, then its bias
    (part after part)."""
    if isinstance(projection, IntLinearParts):
        return [buffer for part in projection.parts for buffer in _buffers(part)]
    return [getattr(projection, name) for name in _STREAMED[type(projection)]] + [projection.bias]


def _weight(norm: Module | None) -> torch.Tensor | None:
    return None if norm is None else norm.weight


_RELEASE_EVERY = 256 << 20  # bytes of weights moved between hand-backs of the old copies' memory


def gather_weights(model: LlamaForCausalLM) -> None:
    """Every Bf16Linear's, Float32Linear's and IntLinear's weights moved, in the order a step reads them (the
    modules' order: layer by layer, then the head), into one arena on huge pages (huge_pages.py).
    Only the addresses change."""
    slots = [(module, name) for module in model.modules() if type(module) in _STREAMED
             for name in _STREAMED[type(module)] if getattr(module, name) is not None]
    if not slots:
        return
    embed = model.model.embed_tokens
    tied = isinstance(embed, IntEmbedding) and embed.codes is getattr(model.lm_head, "codes", None)
    arena = Arena(Arena.size_of([getattr(module, name) for module, name in slots]))
    moved = 0
    for module, name in slots:
        setattr(module, name, arena.take(getattr(module, name)))  # the old copy goes as it is replaced
        moved += getattr(module, name).nbytes
        if moved >= _RELEASE_EVERY:  # else the old copies stay resident until the end: twice the weights
            release_freed()
            moved = 0
    release_freed()
    # the lookups read the head's moved table
    if isinstance(embed, PackedEmbedding):
        model.model.embed_tokens = PackedEmbedding(model.lm_head)
    elif tied:
        model.model.embed_tokens = IntEmbedding(model.lm_head, embed.dtype)


def apply(model: LlamaForCausalLM, *, pack: bool, routers: bool, huge_pages: bool, elementwise: bool) -> None:
    """What model/backends.py chose, in place and in order: projections packed, routers packed, all
    gathered onto huge pages, then the elementwise and routing kernels."""
    if pack:
        pack_linears(model)
    if routers:
        pack_routers(model)
    if huge_pages:
        gather_weights(model)
    if elementwise:
        use_cpu_kernels(model)
